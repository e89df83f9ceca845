"""The Kubernetes manifests in docker/k8s: every field checked against the `kubernetes`
client's models (an unknown or misspelt field fails, as do wrong types and missing
required fields), then the structure expbuf relies on. The ServiceMonitor is a CRD that
the client has no model for; its fields are checked by hand."""

from __future__ import annotations

import datetime
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global yaml, kubernetes, k8s
    yaml = pytest.importorskip("yaml")
    kubernetes = pytest.importorskip("kubernetes")
    from kubernetes import client as k8s


K8S = Path(__file__).parent.parent / "docker" / "k8s"
MODELS = {
    ("v1", "Service"): "V1Service",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
}
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def check(data: Any, kind: str, where: str) -> None:
    """`data` fits the model type `kind` field by field (names, types, nested models)."""
    if kind.startswith("List["):
        assert isinstance(data, list), f"{where}: expected a list"
        for index, item in enumerate(data):
            check(item, kind[5:-1], f"{where}[{index}]")
        return
    if kind.startswith("Dict[str, "):
        assert isinstance(data, dict), f"{where}: expected a mapping"
        for key, item in data.items():
            check(item, kind[10:-1], f"{where}.{key}")
        return
    if kind in _PRIMITIVES:
        assert isinstance(data, _PRIMITIVES[kind]), f"{where}: {data!r} is not {kind}"
        return
    if kind == "datetime":
        assert isinstance(data, (str, datetime.datetime)), f"{where}: not a time"
        return
    model = getattr(k8s, kind)
    assert isinstance(data, dict), f"{where}: expected a {kind} mapping"
    fields = {json_name: name for name, json_name in model.attribute_map.items()}
    unknown = set(data) - set(fields)
    assert not unknown, f"{where}: {kind} has no field(s) {sorted(unknown)}"
    for key, value in data.items():
        check(value, model.openapi_types[fields[key]], f"{where}.{key}")


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def model(name: str) -> Any:
    """The manifest as a model object, after the field-by-field check (which the client's own
    deserializer does not do: it drops unknown fields)."""
    data = load(name)
    kind = MODELS[(data["apiVersion"], data["kind"])]
    check(data, kind, name)
    return k8s.ApiClient()._ApiClient__deserialize(data, kind)


def test_the_checker_catches_mistakes() -> None:
    data = load("statefulset.yaml")
    data["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(AssertionError, match=r"V1GRPCAction has no field\(s\) \['prot'\]"):
        check(data, "V1StatefulSet", "statefulset.yaml")
    data = load("statefulset.yaml")
    data["spec"]["replicas"] = "three"
    with pytest.raises(AssertionError, match=r"spec.replicas: 'three' is not int"):
        check(data, "V1StatefulSet", "statefulset.yaml")
    with pytest.raises(ValueError, match="selector"):  # the client refuses a missing required field
        k8s.ApiClient()._ApiClient__deserialize({"spec": {"serviceName": "x", "template": {}}}, "V1StatefulSet")


def test_statefulset_gives_each_shard_its_volume_probes_and_name() -> None:
    service = model("service.yaml")
    sts = model("statefulset.yaml")
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses
    assert sts.spec.service_name == service.metadata.name
    assert sts.spec.selector.match_labels == sts.spec.template.metadata.labels == service.spec.selector
    (container,) = sts.spec.template.spec.containers
    ports = {port.name: port.container_port for port in container.ports}
    assert ports == {"grpc": 50051, "metrics": 9400}
    assert {p.name: p.target_port for p in service.spec.ports} == {"grpc": "grpc", "metrics": "metrics"}
    env = {e.name: e for e in container.env}
    assert env["EXPBUF_HOST"].value == "0.0.0.0" and env["EXPBUF_PORT"].value == str(ports["grpc"])
    assert env["EXPBUF_METRICS_PORT"].value == str(ports["metrics"])
    assert env["EXPBUF_SHARD"].value_from.field_ref.field_path == "metadata.name"
    (claim,) = sts.spec.volume_claim_templates
    (mount,) = container.volume_mounts
    assert mount.name == claim.metadata.name and mount.mount_path == env["EXPBUF_DATA"].value
    assert claim.spec.access_modes == ["ReadWriteOnce"] and claim.spec.resources.requests["storage"]
    for probe in (container.startup_probe, container.readiness_probe, container.liveness_probe):
        assert probe.grpc.port == ports["grpc"]
    assert container.readiness_probe.grpc.service == "expbuf.v1.ExperienceBuffer"
    assert container.resources.requests["cpu"] and container.resources.requests["memory"]
    # The quick start serves in seconds at any size and keeps RSS under 1 GB (README, "Damaged data";
    # bench/RESULTS.md, "Restart at any size"): the startup probe gives it 30 s, the memory limit room
    # for 1 GiB of pushes in flight at 3x.
    startup = container.startup_probe
    assert startup.period_seconds * startup.failure_threshold == 30
    assert (container.resources.requests["memory"], container.resources.limits["memory"]) == ("2Gi", "6Gi")
    assert sts.spec.template.spec.security_context.run_as_user == 10001  # the image's user


def test_disruption_budget_and_service_monitor_select_the_shards() -> None:
    pdb = model("pdb.yaml")
    labels = model("statefulset.yaml").spec.template.metadata.labels
    assert pdb.spec.max_unavailable == 1 and pdb.spec.selector.match_labels == labels
    monitor = load("servicemonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    check(monitor["metadata"], "V1ObjectMeta", "servicemonitor.yaml.metadata")
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    check(monitor["spec"]["selector"], "V1LabelSelector", "servicemonitor.yaml.spec.selector")
    assert monitor["spec"]["selector"]["matchLabels"] == model("service.yaml").metadata.labels
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings"}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+[smh]", endpoint["interval"])


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_every_image_tag_is_the_package_version() -> None:
    """The image holds the package: its tag in the manifests, the Dockerfile's build line and the
    docs is pyproject.toml's version, the one source (expbuf --version reads it too)."""
    version = tomllib.loads((K8S.parent.parent / "pyproject.toml").read_text())["project"]["version"]
    image = model("statefulset.yaml").spec.template.spec.containers[0].image
    assert image == f"expbuf:{version}", image
    root = K8S.parent.parent
    files = [*root.glob("docker/**/*"), *root.glob("docs/**/*.md"), root / "README.md"]
    tags = {
        (str(path.relative_to(root)), tag)
        for path in files
        if path.is_file() and path.suffix in {"", ".md", ".yaml", ".yml"}
        for tag in re.findall(r"\bexpbuf:(\d+\.\d+\.\d+)\b", path.read_text())
    }
    assert tags and all(tag == version for _, tag in tags), sorted(tags)
