"""A table's typed counters (server/store/core/table_state/counters.py): they read and write the stored JSON of
the releases before them byte for byte, keep what a newer release stored, and refuse a
misspelt counter or a count that is not a number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expbuf.client import BufferClient
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig
from expbuf.server.store import STATES, Store
from expbuf.server.store.core.table_state.counters import NAMES, Counters
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.tables import integrity

from helpers import group_items

# A table's counters as the release before the typed counters stored them, after the pushes,
# sample and version report of `_run` (written by that release from the same steps).
STORED_BEFORE = (
    b'{"pending":1,"computing":0,"ready":2,"leased":0,"consumed":2,"evicted":0,"dropped":0,"failed":0,'
    b'"bytes":1992,"groups_pending":1,"groups_computing":0,"groups_ready":1,"groups_leased":0,"groups_dropped":0,'
    b'"groups_failed":0,"pushed":5,"duplicates":0,"sampled":2,"leases_expired":0,"bytes_pushed":3320,'
    b'"bytes_sampled":1328,"evicted_total":0,"dropped_zero_variance":0,"dropped_timeout":0,'
    b'"dropped_std_threshold":0,"dropped_stale":0,"overlong_penalised":0,"rewards_seen":0,"rewards_clipped":0,'
    b'"advantages_seen":0,"advantages_clipped":0,"submitted":0,"admitted":0,"grants_expired":0,'
    b'"rollouts_rejected":0,"stale_dropped":0,"insert_blocked_seconds":0,"sample_blocked_seconds":0,'
    b'"rate_inserted":4,"rate_sampled":2,"next_seq":5,"next_rseq":2,"min_version":1,"trainer_version":3,'
    b'"max_version":1,"last_failure":"","reward_moments":null}'
)

# What this release stores for the same steps: the counters it added, in their places.
STORED_NOW = (
    STORED_BEFORE.replace(b'"failed":0,', b'"failed":0,"quarantined":0,')
    .replace(b'"leases_expired":0,', b'"leases_expired":0,"damaged":0,')
    .replace(
        b'"dropped_stale":0,',
        b'"dropped_stale":0,"dropped_short":0,"dropped_claim_ended":0,"runs_failed":0,"groups_short":0,"groups_timed_out":0,"tokens_masked":0,"partials":0,'
        b'"partial_bytes":0,"pieces_pushed":0,"values":0,"value_bytes":0,',
    )
)
ADDED = {
    "quarantined": 0, "damaged": 0, "dropped_short": 0, "dropped_claim_ended": 0, "runs_failed": 0,
    "groups_short": 0, "groups_timed_out": 0, "tokens_masked": 0,
    "partials": 0, "partial_bytes": 0, "pieces_pushed": 0, "values": 0, "value_bytes": 0,
}  # fmt: skip


def _run(store: Store) -> None:
    store.create_table(TableConfig.of(name="t", estimator="none", group_size=2))
    store.put("t", group_items(0, 0, 2) + group_items(0, 1, 2) + group_items(0, 2, 1))
    store.sample(TakeSpec("t", num_groups=1))
    store.set_trainer_version("t", 3)


def _stored(store: Store, table: str) -> bytes:
    with store.environment.read() as txn:
        prefix = layout.table_prefix(store.catalog.lookup(table)[0])
        return bytes(txn.get(prefix, db=store.db["counters"]))


def _overwrite(store: Store, table: str, raw: bytes) -> None:
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    store.environment.submit(lambda txn: txn.put(prefix, raw, db=store.db["counters"]))


def test_the_same_steps_store_the_same_bytes_as_before(tmp_path: Path) -> None:
    with Store(tmp_path / "data", clock=lambda: 1_000_000.0, seed=7) as store:
        _run(store)
        assert _stored(store, "t") == STORED_NOW


def test_counters_stored_before_open_unchanged_and_go_on_counting(tmp_path: Path) -> None:
    """The stored form of the release before, laid into a table whose data it counts: the
    store opens it, reports it, checks clean, and counts on from it."""
    with Store(tmp_path / "data", clock=lambda: 1_000_000.0, seed=7) as store:
        _run(store)
        _overwrite(store, "t", STORED_BEFORE)
    with Store(tmp_path / "data", clock=lambda: 1_000_000.0, seed=7) as store:
        in_memory = ("oldest_age_seconds", "staged_bytes")  # not stored counters
        reported = {k: v for k, v in store.stats("t").items() if k not in in_memory}
        assert reported == json.loads(STORED_BEFORE) | ADDED
        assert store.verify("t") == []
        store.put("t", group_items(0, 2, 2)[1:])  # completes the pending group
        stats = store.stats("t")
        assert (stats["pending"], stats["ready"], stats["groups_ready"], stats["pushed"]) == (0, 4, 2, 6)
        assert store.verify("t") == []


def test_a_tables_counters_read_alone_are_what_its_stats_report(tmp_path: Path) -> None:
    """`Store.counters` reads a table's stored counters alone (the advantage worker's start reads of
    each table whether it holds experiences pending or computing): what its stats report of them,
    without the oldest live experience's age and the bytes staged, which stats read beside them."""
    with Store(tmp_path / "data", clock=lambda: 1_000_000.0, seed=7) as store:
        _run(store)
        counters = store.counters("t")
        assert (counters.pending, counters.computing, counters.ready, counters.consumed) == (1, 0, 2, 2)
        reported = {k: v for k, v in store.stats("t").items() if k not in ("oldest_age_seconds", "staged_bytes")}
        assert counters.to_dict() == reported


def test_an_older_release_s_missing_counters_read_as_zero(tmp_path: Path) -> None:
    """Counters stored without the ones added since (admission, shaping, blocked seconds):
    those read as zero or unset, the others as stored."""
    older = {k: v for k, v in json.loads(STORED_BEFORE).items() if k not in ("submitted", "trainer_version")}
    counters = Counters.decode(json.dumps(older).encode())
    assert counters.submitted == 0 and counters.trainer_version is None and counters.pushed == 5


def test_a_newer_release_s_counters_are_kept_as_they_were() -> None:
    newer = json.loads(STORED_NOW) | {"a_newer_count": 7}
    counters = Counters.decode(json.dumps(newer, separators=(",", ":")).encode())
    assert "a_newer_count" not in counters.to_dict()
    assert json.loads(counters.encode()) == newer


def test_counters_read_back_from_what_was_written_are_the_callers_own() -> None:
    """The counters a transaction wrote are read back by the next from memory (counters._Decoded):
    the same as decoding the stored form, and changing what was read (a list counter, a newer
    release's counter) changes neither what was written nor what the next read gets."""
    written = Counters.decode(json.dumps(json.loads(STORED_NOW) | {"a_newer_count": [1, 2]}).encode())
    written.pushed, written.reward_moments, written.insert_blocked_seconds = 9, [0.5, 0.25, 3.0], 1.5
    raw = written.encode()
    first = Counters.decode(raw)
    assert first == written and first == Counters.from_dict(json.loads(raw))
    assert type(first.reward_moments) is list and first.encode() == raw
    first.reward_moments.append(7.0)  # type: ignore[union-attr]
    first.unknown["a_newer_count"] = 0
    first.pushed += 1
    again = Counters.decode(raw)
    assert again == written and again.reward_moments == [0.5, 0.25, 3.0] and again.unknown == {"a_newer_count": [1, 2]}


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"ready": 2**40, "pending": -3, "insert_blocked_seconds": 0.1, "rate_sampled": 1e300, "min_version": 0},
        {"rate_inserted": float("nan"), "rate_sampled": float("inf"), "sample_blocked_seconds": float("-inf")},
        {"last_failure": 'group "g%s": \u00e9\n\u2028', "reward_moments": [0.5, float("nan"), 3], "trainer_version": 7},
        {"pushed": True, "bytes": 1.0},
    ],
)
def test_the_stored_form_is_the_json_encoders_byte_for_byte(values: dict[str, object]) -> None:
    """The known counters are written by a template for their values' types (counters._Forms), not
    the JSON encoder: the bytes are the encoder's for ints, floats (NaN and infinities as it writes
    them), None, text that needs escapes, a list, and a type a template meets first."""
    counters = Counters(**values)  # type: ignore[arg-type]
    expected = json.dumps(counters.to_dict(), separators=(",", ":")).encode()
    assert counters.encode() == expected
    counters.ready += 1
    assert counters.encode() == json.dumps(counters.to_dict(), separators=(",", ":")).encode()


def test_a_misspelt_counter_is_an_error_not_a_new_counter() -> None:
    counters = Counters()
    with pytest.raises(AttributeError):
        counters.pushd = 1  # type: ignore[attr-defined]
    with pytest.raises(KeyError, match="no counter 'pushd'"):
        counters.add_counts({"pushd": 1})
    with pytest.raises(KeyError):
        counters.add("leasd", 1)
    for state in STATES:  # every state has its counter
        counters.add(state, 2)
        assert counters.in_state(state) == 2
    assert set(NAMES) == set(json.loads(STORED_NOW))


def test_a_count_that_is_not_a_number_is_damage(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_size=2))
        _overwrite(store, "t", STORED_BEFORE.replace(b'"pushed":5', b'"pushed":"5"'))
        with store.environment.read() as txn:
            problems = integrity.scan(txn, store.db, 0.0, strays=False, tables=False)[""]
    assert problems == ["the counters of table 't' do not decode (counter pushed is '5', not a number)"]


def test_the_stats_rpc_reports_each_counter_under_its_name(tmp_path: Path) -> None:
    """Every TableStats field named as a counter carries that counter; the versions carry -1
    while unknown; over a real server and a real client."""
    server = ExpbufServer(ServerConfig(data=str(tmp_path / "data"), port=0, metrics_port=0)).start()
    try:
        server.store.create_table(TableConfig.of(name="t", estimator="none", group_size=2))
        server.store.put("t", group_items(0, 0, 2) + group_items(0, 1, 1))
        server.store.sample(TakeSpec("t", num_groups=1))
        with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
            before = client.stats("t")["t"]
            assert (before.min_model_version, before.trainer_version) == (1, -1)
            client.set_trainer_version(4, table="t")
            reported = client.stats("t")["t"]
        stored = server.store.stats("t")
    finally:
        server.stop(grace=1)
    fields = [field.name for field in pb.TableStats.DESCRIPTOR.fields]
    named = [name for name in fields if name in stored and name != "oldest_age_seconds"]  # an age moves on
    assert len(named) == 33 and "oldest_age_seconds" in fields and reported.oldest_age_seconds >= 0
    assert {name: getattr(reported, name) for name in named} == {name: stored[name] for name in named}
    assert (reported.min_model_version, reported.max_model_version) == (stored["min_version"], 1)
    assert (reported.pushed, reported.consumed, reported.pending, reported.trainer_version) == (3, 2, 1, 4)
