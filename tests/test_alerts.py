"""The alerting rules an operator loads into Prometheus (docker/alerts.yml): each parses as PromQL,
reads only series a live server exports, with label names they carry and label values the server
gives them, and has its runbook in docs/operations/alerts.md; and the storage gauges they read say
the room the store has."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import promql_parser as promql
import pytest
import yaml

from expbuf.client import BufferClient, BufferError, trxp
from expbuf.client.schema.reasons import Reason
from expbuf.server.store.schema.estimator_registry import Estimator
from expbuf.server.store.schema.states import STATES

from conftest import BAD_DIR, Servers, payload
from helpers import group_items, registered, scrape, wait_for

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
RUNBOOKS = ROOT / "docs" / "operations" / "alerts.md"
# Labels Prometheus gives every series of a target (job, instance), and the one a shard's series carry.
TARGET_LABELS = {"job", "instance", "shard"}
# The values a rule may match, by label: what the server gives that label.
VALUES = {
    "reason": {reason.value for reason in Reason} | {"zero_variance", "timeout", "std_threshold", "stale", "short"},
    "outcome": {"retried", "failed"},
    "state": set(STATES),
    "job": {"expbuf"},
}


def rules() -> list[dict]:
    loaded = yaml.safe_load((DOCKER / "alerts.yml").read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def test_the_rules_are_prometheus_alerting_rules_with_runbooks() -> None:
    loaded = yaml.safe_load((DOCKER / "alerts.yml").read_text())
    assert set(loaded) == {"groups"} and all(set(group) == {"name", "rules"} for group in loaded["groups"])
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) >= 10
    headings = re.findall(r"^## (\w+)$", RUNBOOKS.read_text(), re.MULTILINE)
    assert headings == names, "docs/operations/alerts.md has a section per alert, in the file's order"
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Expbuf[A-Z]\w+", rule["alert"])
        promql.parse(rule["expr"])  # a syntax error would stop Prometheus loading the file
        if "for" in rule:
            assert promql.parse_duration(rule["for"]).total_seconds() > 0
        assert rule["labels"] == {"severity": rule["labels"]["severity"]}
        assert rule["labels"]["severity"] in ("critical", "warning")
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook"}, rule["alert"]
        assert annotations["runbook"] == f"docs/operations/alerts.md#{rule['alert'].lower()}"
    # Prometheus loads the file, and compose mounts it where Prometheus reads it.
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert prometheus["scrape_configs"][0]["job_name"] == "expbuf"
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]


def test_the_kubernetes_rule_holds_the_same_rules() -> None:
    """docker/k8s's PrometheusRule (Prometheus Operator) holds the groups of docker/alerts.yml, as they
    are: an alert changed in one and not the other fails here."""
    manifest = yaml.safe_load((DOCKER / "k8s" / "prometheusrule.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert set(manifest) == {"apiVersion", "kind", "metadata", "spec"} and set(manifest["spec"]) == {"groups"}
    assert manifest["metadata"]["labels"] == {"app.kubernetes.io/name": "expbuf"}
    assert manifest["spec"]["groups"] == yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"]


def _selectors(expr: str) -> tuple[list[promql.VectorSelector], set[str]]:
    """An expression's series selectors, and the label names its aggregations and matchings name."""
    found: list[promql.VectorSelector] = []
    grouping: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql.VectorSelector):
            found.append(node)
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None and node.modifier.matching is not None:
            grouping.update(node.modifier.matching.labels)

    promql.walk(promql.parse(expr), visit)
    return found, grouping


def test_every_rule_reads_series_a_live_server_exports(start_server: Servers) -> None:
    """After a workload that gives every series a rule reads a sample (a refusal, a lease that
    expires, a dropped group, an estimator that raises), each selector names an exported metric (or
    Prometheus's own `up`), matches label names its series carry, and values the server gives them:
    a rule that reads a misspelt name or value stays silent for ever."""

    def broken(batch: object) -> object:
        raise RuntimeError("the estimator of this test raises")

    server = start_server()
    with registered(Estimator("alerts_broken", ingest=broken)) as name:
        with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
            c.push(payload("grpo_group.trxp"))
            next(c.sample(num_groups=1, delivery="lease", lease_seconds=0.5, max_batches=1))
            with pytest.raises(BufferError):
                c.push((BAD_DIR / "bad_magic.bin").read_bytes())
            c.create_table("dapo", drop_zero_variance=True)
            c.push(trxp.build(group_items(1, 0, 4, reward=1.0)), table="dapo")  # dropped: zero variance
            c.create_table("broken", group_size=2, estimator=name)
            c.push(trxp.build(group_items(1, 0, 2, reward=1.0)), table="broken")
            wait_for(lambda: c.stats()["default"].leases_expired == 1, "the lease expired")

            def failures() -> bool:
                return any(metric == "expbuf_advantage_failures_total" for metric, _ in scrape(server.metrics_port))

            wait_for(failures, "the estimator's failure counted")
        samples = scrape(server.metrics_port)
    labels: dict[str, set[str]] = {}
    for metric, pairs in samples:
        labels.setdefault(metric, set()).update(label for label, _ in pairs)
    labels["up"] = set()
    for rule in rules():
        selectors, grouping = _selectors(rule["expr"])
        assert selectors, rule["alert"]
        carried: set[str] = set(TARGET_LABELS)
        for selector in selectors:
            assert selector.name in labels, f"{rule['alert']} reads {selector.name}, which no server exports"
            carried |= labels[selector.name]
            for matcher in selector.matchers.matchers:
                assert matcher.name in labels[selector.name] | TARGET_LABELS, (rule["alert"], matcher.name)
                wanted = VALUES.get(matcher.name)
                if wanted is not None and matcher.op in (promql.MatchOp.Equal, promql.MatchOp.Re):
                    given = matcher.value.split("|") if matcher.op == promql.MatchOp.Re else [matcher.value]
                    assert set(given) <= wanted, (rule["alert"], matcher.name, set(given) - wanted)
        assert grouping <= carried, (rule["alert"], grouping - carried)


def test_the_storage_gauges_say_the_room_the_store_has(start_server: Servers) -> None:
    """The gauges ExpbufStorageNearlyFull reads: the map's bound (max_map_size) and the data
    directory's disk, as the operating system says them."""
    server = start_server()
    samples = scrape(server.metrics_port)
    disk = shutil.disk_usage(start_server.data)
    assert samples[("expbuf_lmdb_map_max_bytes", ())] == server.store.max_map_size == 1 << 40
    assert samples[("expbuf_disk_size_bytes", ())] == disk.total
    assert abs(samples[("expbuf_disk_free_bytes", ())] - disk.free) < 256 << 20  # other writers share the disk
    assert 0 < samples[("expbuf_storage_bytes", ())] < samples[("expbuf_lmdb_map_max_bytes", ())]
