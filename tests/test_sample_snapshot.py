"""Sampled payloads read as views of a snapshot (server/store/disk/snapshot.py): the bytes
delivered are the ones stored, whatever commits, map growth or closing happen while a
batch is held, and a released batch cannot be read again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.client.rpc.sample_reply import Parts, read_sample_reply
from expbuf.server.rpc.sample.replies import sample_reply
from expbuf.server.store import Store
from expbuf.server.store.disk.environment import MAX_SNAPSHOTS
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, take

PLAIN = TableConfig.of(name="plain", estimator="none", group_size=2)


def stored(items: list[trxp.RawItem]) -> list[trxp.RawItem]:
    """The items as a batch of them reads back."""
    return trxp.parse(trxp.join([trxp.pack_item(item) for item in items]))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(tmp_path / "data", map_size=16 << 20, seed=3) as s:
        s.create_table(PLAIN)
        yield s
        assert s.verify("plain") == []


def test_a_batch_reads_its_payloads_from_the_map_until_released(store: Store) -> None:
    items = group_items(1, 0, 2)
    store.put("plain", items)
    batch = take(store, "plain", num_groups=1)
    assert all(isinstance(blob, memoryview) for blob in batch.blobs)  # not copied when taken
    assert trxp.parse(batch.payload) == stored(items)
    assert trxp.parse(batch.payload) == stored(items)  # readable more than once
    batch.release()
    assert batch.blobs == []
    with pytest.raises(StoreError, match="released"):
        _ = batch.payload


def test_payloads_stored_in_the_sampling_commit_are_the_new_ones(store: Store) -> None:
    """A group deleted, pushed again with other content under the same uids and sampled, all
    in one commit: the snapshot (the state before that commit) still holds the old payloads
    under those keys, and the batch must carry the new ones."""
    old = group_items(1, 0, 2, reward=0.0)
    new = group_items(1, 0, 2, reward=1.0)
    assert [i.uid for i in old] == [i.uid for i in new] and trxp.pack_item(old[0]) != trxp.pack_item(new[0])
    store.put("plain", old)
    environment = store.environment
    started, go = threading.Event(), threading.Event()

    def hold_writer(_txn: object) -> None:
        started.set()
        go.wait(30)

    results: dict[str, object] = {}
    threads = [threading.Thread(target=environment.submit, args=(hold_writer,))]
    threads[0].start()
    assert started.wait(30)
    steps = [
        ("delete", lambda: store.delete("plain", group_ids=["1/0"])),
        ("put", lambda: store.put("plain", new)),
        ("sample", lambda: take(store, "plain", num_groups=1, wait_seconds=5)),
    ]
    for queued, (name, step) in enumerate(steps, start=1):
        thread = threading.Thread(target=lambda n=name, s=step: results.__setitem__(n, s()))
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 30
        while environment.writer._queue.qsize() < queued and time.monotonic() < deadline:
            time.sleep(0.001)
        assert environment.writer._queue.qsize() == queued  # each request queued behind the previous one
    batches_before = environment.batches
    go.set()
    for thread in threads:
        thread.join(30)
    assert environment.batches == batches_before + 1  # delete, put and sample in one commit
    assert results["delete"] == 2
    batch = results["sample"]
    assert batch is not None and batch.uids == [i.uid for i in new]
    assert trxp.parse(batch.payload) == stored(new)


def test_held_batches_stay_readable_through_map_growth_and_close(tmp_path: Path) -> None:
    s = Store(tmp_path / "data", map_size=1 << 20)
    s.create_table(PLAIN)
    groups = [group_items(1, task, 2, response=256) for task in range(4)]
    for items in groups:
        s.put("plain", items)
    held = [take(s, "plain", num_groups=1) for _ in groups]
    assert all(batch.snapshot.open for batch in held)
    before = s.storage_info()["map_size"]
    grown = threading.Thread(
        daemon=True, target=lambda: [s.put("plain", group_items(2, t, 2, response=2048)) for t in range(40)]
    )
    grown.start()
    grown.join(60)
    assert not grown.is_alive()  # the growth did not wait for the held batches
    assert s.storage_info()["map_size"] > before
    assert not any(batch.snapshot.open for batch in held)  # their views were copied first
    for batch, items in zip(held, groups, strict=True):
        assert trxp.parse(batch.payload) == stored(items)
    latest = take(s, "plain", num_groups=1)
    s.close()
    assert not latest.snapshot.open
    assert trxp.parse(latest.payload) == stored(group_items(2, 0, 2, response=2048))


def test_more_held_batches_than_open_snapshots(store: Store) -> None:
    groups = [group_items(1, task, 2) for task in range(MAX_SNAPSHOTS + 4)]
    for items in groups:
        store.put("plain", items)
    held = [take(store, "plain", num_groups=1) for _ in groups]
    assert sum(batch.snapshot.open for batch in held) == MAX_SNAPSHOTS
    for batch, items in zip(held, groups, strict=True):
        assert trxp.parse(batch.payload) == stored(items)


def test_concurrent_held_batches_through_map_growth_are_each_delivered_once(tmp_path: Path) -> None:
    """More consumers than open snapshots, each taking held batches and consuming the last
    one in the commit that takes the next (as a Sample stream does), while pushes grow the
    map and Gets and ReadFields (whose snapshots open on their own threads) read the same
    payloads: every experience arrives once, as stored, and no reader is left open."""
    s = Store(tmp_path / "data", map_size=1 << 20, seed=7)
    s.create_table(PLAIN)
    groups = [group_items(1, task, 2, response=6000) for task in range(120)]
    packed = {item.uid: trxp.pack_item(item) for items in groups for item in items}
    for items in groups[:60]:  # more than the initial map holds
        s.put("plain", items)
    pushed = threading.Event()
    delivered: list[str] = []
    wrong: list[str] = []
    errors: list[BaseException] = []

    def produce() -> None:
        for items in groups[60:]:
            s.put("plain", items)
        pushed.set()

    def consume(owner: str) -> None:
        last = ""
        try:
            while True:
                batch = s.sample(TakeSpec("plain", num_groups=1), hold=True, owner=owner, confirm=last, timeout=0.3)
                last = ""
                if batch is None:
                    if pushed.is_set():
                        return
                    continue
                try:
                    items = batch.render(lambda parts: trxp.parse(b"".join(parts)))
                finally:
                    batch.release()
                delivered.extend(batch.uids)
                wrong.extend(item.uid for item in items if trxp.pack_item(item) != packed[item.uid])
                last = batch.lease_id
        except BaseException as exc:
            errors.append(exc)
        finally:
            if last:
                s.ack(last, "plain", owner)

    def read() -> None:
        uids = list(packed)
        while not pushed.is_set():
            wrong.extend(uid for uid, blob in s.get("plain", uids[:40]).items() if blob != packed[uid])

    def read_fields() -> None:
        uids = list(packed)
        try:
            while not pushed.is_set():
                batch, _ = s.read_fields("plain", uids[-40:], whole=True)
                try:
                    items = batch.render(lambda parts: trxp.parse(b"".join(parts)))
                finally:
                    batch.release()
                wrong.extend(item.uid for item in items if trxp.pack_item(item) != packed[item.uid])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce), threading.Thread(target=read)]
    threads += [threading.Thread(target=read_fields) for _ in range(4)]
    threads += [threading.Thread(target=consume, args=(f"c{n}",)) for n in range(MAX_SNAPSHOTS + 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads) and errors == [] and wrong == []
    assert sorted(delivered) == sorted(packed)
    assert s.storage_info()["map_size"] > 1 << 20
    assert s.environment.readers._readers == 0
    stats = s.stats("plain")
    assert (stats["consumed"], stats["leased"], stats["ready"]) == (len(packed), 0, 0)
    assert s.verify("plain") == []
    s.close()


@pytest.mark.parametrize("fields", [(), ("tokens", "logprobs")], ids=["trxp", "columns"])
def test_a_reply_in_parts_is_the_same_bytes_when_its_snapshot_ends_between_parts(
    store: Store, fields: tuple[str, ...]
) -> None:
    """The parts after the first are cut from runs the snapshot keeps: a map resize or a close
    that ends it between two parts copies them first, and the reply is still the stored bytes."""
    items = group_items(1, 0, 2, response=4_000)
    store.put("plain", items)
    spec = TakeSpec(table="plain", num_groups=1, fields=fields, delivery="replay")

    def reply(detach: bool) -> bytes:
        batch = take(store, "plain", num_groups=1, delivery="replay")
        parts = sample_reply(batch, spec, 0.0, limit=4096, parts=True)
        whole = [next(parts)]
        if detach:
            assert batch.snapshot is not None and batch.snapshot.open
            batch.snapshot.detach()  # what a map resize does
        whole += list(parts)
        assert len(whole) > 2
        glued = Parts()
        for message in whole[:-1]:
            assert glued.add(read_sample_reply(message)) is None
        done = glued.add(read_sample_reply(whole[-1]))
        assert done is not None
        done.rest.ClearField("times_sampled")  # the second delivery counts one more
        return bytes(done.payload) + done.rest.SerializeToString() + bytes(b"".join(done.values or ()))

    assert reply(detach=True) == reply(detach=False)


def test_the_writer_does_not_wait_for_a_reply_built_from_the_oldest_snapshot(store: Store) -> None:
    """One snapshot too many detaches the oldest; while the oldest's reply is being built
    (its reading held), the writer marks it instead of waiting, and the reader detaches it
    as its reading ends, its batch still readable and whole."""
    groups = [group_items(1, task, 2) for task in range(MAX_SNAPSHOTS + 1)]
    for items in groups:
        store.put("plain", items)
    held = [take(store, "plain", num_groups=1) for _ in groups[:MAX_SNAPSHOTS]]
    oldest = held[0]
    reading, done = threading.Event(), threading.Event()

    def build_reply() -> None:
        oldest.read(lambda: (reading.set(), done.wait(30)))

    builder = threading.Thread(target=build_reply)
    builder.start()
    assert reading.wait(30)
    taken: list[object] = []
    taker = threading.Thread(target=lambda: taken.append(take(store, "plain", num_groups=1)))
    taker.start()
    taker.join(30)
    try:
        assert taken, "the writer waited for a reply being built"
        assert oldest.snapshot.open  # still being read
    finally:
        done.set()
        builder.join(30)
    assert not oldest.snapshot.open  # detached as its reading ended
    assert trxp.parse(oldest.payload) == stored(groups[0])
    assert sum(batch.snapshot.open for batch in [*held, *taken]) == MAX_SNAPSHOTS


def test_a_read_whose_snapshot_ends_before_it_begins_opens_another(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ReadFields opens its snapshot in the writer and reads it on its own thread; between the
    two, later reads may have ended it (too many open). The read is made from a fresh one."""
    items = group_items(1, 0, 2)
    store.put("plain", items)
    opened = store.environment.snapshot
    ended = []

    def ended_at_first() -> object:
        snapshot = opened()
        if not ended:
            snapshot.detach()
            ended.append(snapshot)
        return snapshot

    monkeypatch.setattr(store.environment, "snapshot", ended_at_first)
    batch, missing = store.read_fields("plain", [item.uid for item in items], whole=True)
    assert ended and not ended[0].open and missing == []
    assert trxp.parse(batch.payload) == stored(items)
    batch.release()


def test_a_snapshot_is_not_detached_while_its_opener_has_not_held_what_it_read(store: Store) -> None:
    """A take reads its payloads before it holds them; a ReadFields on another thread opening one
    snapshot too many then must not end the take's: the oldest unpinned one goes instead."""
    groups = [group_items(1, task, 2) for task in range(MAX_SNAPSHOTS)]
    for items in groups:
        store.put("plain", items)
    taking = store.environment.snapshot()  # as a take opens one: pinned until it holds its reads
    held = [take(store, "plain", num_groups=1) for _ in groups[: MAX_SNAPSHOTS - 1]]
    others = [store.environment.snapshot() for _ in range(3)]  # as ReadFields open theirs
    assert taking.open and taking.pinned
    assert [batch.snapshot.open for batch in held[:3]] == [False, False, False]  # the oldest went
    assert all(trxp.parse(batch.payload) == stored(items) for batch, items in zip(held, groups, strict=False))
    for snapshot in [taking, *others]:
        snapshot.release()
