"""Damage of a rollout held in pieces beyond what test_partial_rollouts.py covers: a head (the
record naming its pieces, their sizes and digests) that a damaged page left undecodable, met as a
damaged piece is (refused DATA_LOSS naming the rollout, its pieces dropped so that its worker
starts it over, never an internal error), and a damaged rollout that a prompt's claim hands to its
next attempt, dropped rather than handed on."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from expbuf.client import BufferClient, trxp
from expbuf.client.errors import DataLossError
from expbuf.client.rollout_pieces import split
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import DamagedPiece
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from test_partial_rollouts import hurt_piece, long_rollout, pushed_again_whole, read_back, rollout, same
from test_store import Clock

UNDECODED = "its head does not decode"


def hurt_head(store: Store, table: str, uid: str) -> None:
    """Cut the head of the uid's rollout held in pieces short in LMDB, as a damaged page leaves a
    record that no longer decodes."""
    key = layout.table_prefix(store.catalog.lookup(table)[0]) + uid.encode() + b"\0"
    db = store.db["partials"]
    store.environment.submit(lambda txn: txn.put(key, bytes(txn.get(key, db=db))[:-3], db=db))


def beside(store: Store) -> int:
    """Another rollout of the same task held in pieces, intact: the bytes it holds."""
    store.put("t", [trxp.from_experience(split(rollout(run=0), [4, 8])[0])])
    return int(store.stats("t")["partial_bytes"])


@pytest.mark.parametrize("met_by", ["its next piece", "its last piece", "its last piece off the writer"])
def test_a_push_over_a_head_that_does_not_decode_is_refused_and_the_rollout_starts_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, met_by: str
) -> None:
    """The push of a piece whose rollout's head no longer decoded failed INTERNAL (the JSON decoder's
    error), each time, and nothing dropped the rollout. It is refused DamagedPiece (DATA_LOSS) naming
    the rollout, nothing of it stored, the rollout's pieces dropped (the others' kept) and counted
    as damage found, so that its worker pushes it again from its first piece, which stores it."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    large = met_by == "its last piece off the writer"
    whole = long_rollout(run=1) if large else rollout(run=1)
    pieces = [trxp.from_experience(p) for p in split(whole, [3000, 6000, 8191] if large else [4, 8])]
    uid, held = whole.eid.uid, 1 if met_by == "its next piece" else len(pieces) - 1
    with Store(tmp_path / "data", map_size=1 << 28) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        other = beside(store)
        for piece in pieces[:held]:
            assert store.put("t", [piece]).partial == [uid]
        if large:  # damaged once the writer asked for the rollout to be put together off it
            together = store.pushing._together

            def hurt_first(*args: object) -> None:
                hurt_head(store, "t", uid)
                together(*args)  # type: ignore[arg-type]

            store.pushing._together = hurt_first  # type: ignore[method-assign]
        else:
            hurt_head(store, "t", uid)
        with pytest.raises(DamagedPiece, match=re.escape(f"partial rollout {uid}: {UNDECODED} (")) as refused:
            store.put("t", [pieces[held]])
        assert refused.value.status == "DATA_LOSS"
        assert "push the rollout again from its first piece" in str(refused.value)
        stats = store.stats("t")
        assert (stats["pushed"], stats["partials"], stats["partial_bytes"], stats["damaged"]) == (0, 1, other, 1)
        assert stats["last_failure"].startswith(f"partial rollout {uid}: {UNDECODED} (")
        assert any(uid in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
        assert store.verify("t") == []
        if large:
            store.pushing._together = together  # type: ignore[method-assign]
        for piece in pieces[:-1]:  # the worker starts the rollout over
            assert store.put("t", [piece]).partial == [uid]
        assert store.put("t", pieces[-1:]).stored == [uid]
        same(read_back(store, "t", uid), whole)
        assert store.verify("t") == []


@pytest.mark.parametrize("named_by", ["task", "uid"])
def test_get_partials_leaves_out_a_rollout_whose_head_does_not_decode_and_drops_it(
    tmp_path: Path, named_by: str
) -> None:
    """get_partials of a task (or a uid) with a rollout whose head no longer decoded failed, the
    task's other rollouts unread. That rollout is left out, its pieces dropped and counted as damage
    found; the others are served."""
    damaged = rollout(run=1)
    with Store(tmp_path / "data", map_size=1 << 24) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=3))
        other = beside(store)
        store.put("t", [trxp.from_experience(split(damaged, [4, 8])[0])])
        hurt_head(store, "t", damaged.eid.uid)
        tids, uids = (["0/0"], []) if named_by == "task" else ([], [damaged.eid.uid, "0/0/0/0/r"])
        payload, rest = store.get_partials("t", tids, uids)
        assert [exp.eid.uid for exp in trxp.decode(payload)] == ["0/0/0/0/r"] and rest == []
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"], stats["damaged"]) == (1, other, 1)
        assert stats["last_failure"].startswith(f"partial rollout {damaged.eid.uid}: {UNDECODED} (")
        assert store.verify("t") == []


@pytest.mark.parametrize("end", ["seal", "timeout", "delete", "fail_runs", "pushed whole"])
def test_a_rollout_whose_head_does_not_decode_goes_where_its_pieces_would(tmp_path: Path, end: str) -> None:
    """A group's end (its seal, its timeout, a Delete of it), its run reported failed or pushed whole
    each drop a rollout's pieces by reading its head: one that no longer decoded failed them (the
    upkeep's tick at every pass, for a timeout). Its pieces go all the same."""
    damaged, clock = rollout(run=1), Clock()
    with Store(tmp_path / "data", map_size=1 << 24, clock=clock) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=3, group_timeout_seconds=5))
        store.put("t", [trxp.from_experience(rollout(run=0))])
        store.put("t", [trxp.from_experience(split(damaged, [4, 8])[0])])
        hurt_head(store, "t", damaged.eid.uid)
        if end == "seal":
            assert store.seal("t", "0/0") == 1
        elif end == "timeout":
            clock.now += 6
            assert store.tick()["groups_timed_out"] == 1
        elif end == "delete":
            assert store.delete("t", group_ids=["0/0"]) == 1
        elif end == "fail_runs":
            assert store.fail_runs("t", [damaged.eid.uid], ["died"]).recorded == [damaged.eid.uid]
        else:
            assert store.put("t", [trxp.from_experience(damaged)]).stored == [damaged.eid.uid]
        stats = store.stats("t")
        assert (stats["partials"], stats["partial_bytes"]) == (0, 0)
        assert store.verify("t") == []


def test_a_head_that_does_not_decode_refuses_its_push_data_loss_and_leaves_the_server_healthy(
    start_server: Servers,
) -> None:
    """Through the server: the next piece's push was refused INTERNAL. It is refused DATA_LOSS (reason
    damaged) naming the rollout, the damage in Stats and expbuf_damaged_total; the health check says
    SERVING, and the rollout pushed again from its first piece is stored with its group."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    whole, partner = rollout(run=1), rollout(run=0, reward=0.0)
    pieces = split(whole, [4, 8])
    with BufferClient(target, timeout=20) as client:
        client.create_table("t", group_size=2, estimator="none")
        assert client.push(pieces[:1], table="t").partial == [whole.eid.uid]
        hurt_head(server.store, "t", whole.eid.uid)
        with pytest.raises(DataLossError, match=re.escape(f"partial rollout {whole.eid.uid}: {UNDECODED}")) as refused:
            client.push(pieces[1:2], table="t")
        assert refused.value.reason == "damaged"
        stats = client.stats("t")["t"]
        assert (stats.pushed, stats.damaged) == (0, 1)
        got = pushed_again_whole(server, client, whole, pieces, partner)
    same(got, whole)
    assert server.store.verify("t") == []


@pytest.mark.parametrize(
    ("damage", "end"),
    [("piece flipped", "release"), ("piece lost", "release"), ("head", "release"), ("head", "expiry")],
)
def test_a_claim_that_ends_drops_a_damaged_rollout_rather_than_hand_it_to_the_next_attempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, end: str
) -> None:
    """A claim that ends before its group is complete hands its attempt's rollouts in pieces to the
    prompt's next attempt. A damaged one was copied as stored, for the next claimant's push to be
    refused over; with a piece lost, or its head undecodable, the claim's end failed (INTERNAL, or
    DATA_LOSS; the table's upkeep at every pass, at its expiry), so the prompt never went back.
    Each rollout is checked as it is handed over: a damaged one is dropped, logged and counted as
    damage found, the others handed on, and the next claimant starts it over."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    clock = Clock()
    with Store(tmp_path / "data", map_size=1 << 24, clock=clock) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.claims.create("t", DatasetRecord("math", size=1))
        (first,), _ = store.claim("t", "math", 1, seconds=60)
        batch, task = f"math/{first.epoch}", f"{first.index}@{first.attempt}"
        intact, damaged = rollout(task, 0, batch), rollout(task, 1, batch)
        for whole in (intact, damaged):
            store.put("t", [trxp.from_experience(split(whole, [4, 8])[0])])
        if damage == "head":
            hurt_head(store, "t", damaged.eid.uid)
        else:
            hurt_piece(store, "t", damaged.eid.uid, 0, "lost" if damage == "piece lost" else "flipped")
        if end == "release":
            assert store.release_claims("t", "math", [(first.epoch, first.index, first.attempt)]) == 1
        else:
            clock.now += 61
            assert store.tick()["failed"] == 0
        stats = store.stats("t")
        assert (stats["partials"], stats["damaged"]) == (1, 1)
        assert stats["last_failure"].startswith(f"partial rollout {damaged.eid.uid}")
        assert any(damaged.eid.uid in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
        assert store.verify("t") == []
        (second,), _ = store.claim("t", "math", 1, seconds=60)
        assert second.attempt == first.attempt + 1
        payload, _ = store.get_partials("t", [f"{batch}/{second.index}@{second.attempt}"])
        (held,) = trxp.decode(payload)
        assert held.eid.run == 0 and held.tokens.numel() == len(split(intact, [4, 8])[0].tokens)
