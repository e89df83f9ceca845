"""A store whose map or disk is full still consumes, acks and deletes, and pushes again once they
made room (disk/environment/room.py): LMDB writes every changed page to a free one, so a consume
needs free pages too, and a store filled to its last page refused every write for good, the
consumes that would have emptied it included. The disk's case runs in a child process that mounts
a small tmpfs of its own (a user namespace, no privilege): its writes meet ENOSPC as a full disk's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import StorageFull
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.services import joined_pushes

from helpers import held_writer, make_experience, take

TABLE = "t"


def _item(batch: int, task: int) -> trxp.RawItem:
    return trxp.from_experience(make_experience(batch, task, 0, response=500, prompt=500))


def _fill(store: Store, batch: int = 1, first: int = 0) -> tuple[int, StorageFull]:
    """Experiences of about 4 KB (of `batch`, tasks from `first`) pushed one a push until the store
    refuses one; (stored, refusal)."""
    for task in range(first, first + 100_000):
        try:
            store.put(TABLE, [_item(batch, task)])
        except StorageFull as exc:
            return task - first, exc
    raise AssertionError("100,000 experiences fitted")


def _drain(store: Store) -> int:
    """Consume every group, 8 a take while there are 8; how many experiences. Each batch's snapshot
    is let go at once, as the server's replies do: a snapshot held keeps the pages freed after it from
    reuse."""
    taken = 0
    for groups in (8, 1):
        while (batch := take(store, TABLE, num_groups=groups, delivery="consume", wait_seconds=0)) is not None:
            taken += len(batch.group_ids)
            batch.release()
    return taken


def test_a_full_map_consumes_to_empty_and_then_takes_pushes_again(tmp_path: Path) -> None:
    with Store(tmp_path, map_size=1 << 20, max_map_size=2 << 20) as store:
        store.create_table(TableConfig.of(TABLE, estimator="none", group_by="none"))
        stored, refusal = _fill(store)
        assert stored > 100, stored
        assert str(tmp_path) in str(refusal) and "kept for consumes" in str(refusal), refusal
        assert _drain(store) == stored  # each consume commits in the room the pushes left
        assert store.stats(TABLE)["ready"] == 0
        again, _ = _fill(store, 3)  # the room the consumes made takes most as many again (tombstones keep some)
        assert again >= stored // 2, (again, stored)
        assert _drain(store) == again
        assert store.verify(TABLE) == []


@pytest.mark.parametrize("layout", ["rows", "records"])
def test_a_full_store_fed_faster_than_it_is_consumed_keeps_its_reserve(tmp_path: Path, layout: str) -> None:
    """Rollouts come faster than the trainer takes them: after each consume, pushes take the room it
    made until refused. Every consume commits, round after round: the pushes leave the reserve free
    whatever pages the consumes took from it (counted in pages in use, not up to LMDB's last page,
    which only grows: counted so, the reserve shrank each round until a consume of one group failed)."""
    with Store(tmp_path, map_size=1 << 20, max_map_size=2 << 20) as store:
        store.create_table(TableConfig.of(TABLE, estimator="none", group_by="none", layout=layout))
        stored, _ = _fill(store)
        for round_ in range(40):
            batch = take(store, TABLE, num_groups=8, delivery="consume", wait_seconds=0)
            assert batch is not None and len(batch.group_ids) == 8, round_
            batch.release()
            pushed, _ = _fill(store, 10 + round_)
            assert pushed <= 16, (round_, pushed)  # about what the consume made room for
        assert store.stats(TABLE)["ready"] > stored // 2
        assert _drain(store) == store.stats(TABLE)["consumed"] - 40 * 8
        assert store.verify(TABLE) == []


def test_an_index_a_consume_waits_for_is_built_in_the_reserve(tmp_path: Path) -> None:
    """A rows table builds its priority index at the first take in that order, in the writer's
    background lane: the build is no push, so it goes on where pushes stopped, and the take with it."""
    with Store(tmp_path, map_size=1 << 20, max_map_size=4 << 20) as store:
        store.create_table(TableConfig.of(TABLE, estimator="none", group_by="none", layout="rows"))
        for per in (256, 1):  # tiny experiences, 256 a push, then one a push
            for task in range(0, 100_000, per):
                try:
                    items = [make_experience(per, task + k, 0, response=1, prompt=1) for k in range(per)]
                    store.put(TABLE, [trxp.from_experience(item) for item in items])
                except StorageFull:
                    break
        batch = take(store, TABLE, num_groups=8, delivery="consume", order="priority", wait_seconds=0)
        assert batch is not None and len(batch.group_ids) == 8
        assert [build for build in store.index_builds() if build.failed] == []


def test_a_store_at_its_reserve_refuses_pushes_before_their_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a count found the store at its reserve, a batch's pushes are refused before they run
    (the writer's last commit counted), while that holds: rollout workers retrying their refused
    pushes cost the writer their whole work each time, beside the consumes that make room."""
    with Store(tmp_path, map_size=1 << 20, max_map_size=2 << 20) as store:
        store.create_table(TableConfig.of(TABLE, estimator="none", group_by="none"))
        _fill(store)
        ran: list[int] = []
        run = joined_pushes.PushRequest.__call__
        monkeypatch.setattr(joined_pushes.PushRequest, "__call__", lambda self, txn: (ran.append(1), run(self, txn))[1])
        for task in range(5):
            with pytest.raises(StorageFull, match="kept for consumes"):
                store.put(TABLE, [_item(7, task)])
        assert ran == [], "a push ran at the reserve"
        assert _drain(store) > 0
        store.put(TABLE, [_item(8, 0)])  # room made: the next count lets pushes run again
        assert ran == [1]


def test_a_consume_in_the_batch_of_a_push_the_full_map_refuses_is_committed(tmp_path: Path) -> None:
    """The writer runs a push and a consume waiting side by side in one transaction: where the push
    finds the map full, the consume is run again without it, and commits."""
    with Store(tmp_path, map_size=1 << 20, max_map_size=2 << 20) as store:
        store.create_table(TableConfig.of(TABLE, estimator="none", group_by="none"))
        stored, _ = _fill(store)
        outcomes: dict[str, object] = {}

        def push() -> None:
            try:
                store.put(TABLE, [_item(2, task) for task in range(100)])  # more than the reserve
                outcomes["push"] = "stored"
            except StorageFull as exc:
                outcomes["push"] = exc

        def consume() -> None:
            try:
                batch = take(store, TABLE, num_groups=8, delivery="consume", wait_seconds=0)
                outcomes["consume"] = None if batch is None else len(batch.group_ids)
            except StorageFull as exc:
                outcomes["consume"] = exc

        go, held = held_writer(store.environment)
        threads = [threading.Thread(target=push), threading.Thread(target=consume)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while store.environment.writer._queue.qsize() < 2:  # both queued behind the held request
            assert time.monotonic() < deadline, "the push and the consume never reached the writer"
            time.sleep(0.01)
        go.set()
        held.result(60)
        for thread in threads:
            thread.join(60)
        assert outcomes["consume"] == 8, outcomes
        assert isinstance(outcomes["push"], StorageFull), outcomes
        assert store.stats(TABLE)["ready"] == stored - 8
        assert store.verify(TABLE) == []


_DISK_SCRIPT = """
import json, subprocess, sys, threading, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import StorageFull
from expbuf.server.store.services import joined_pushes
from expbuf.server.store.schema.table_config import TableConfig
from helpers import held_writer
import test_full_store as t

disk = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], check=True)
got = {}
with Store(disk / "data") as store:
    store.create_table(TableConfig.of(t.TABLE, estimator="none", group_by="none"))
    got["stored"], refusal = t._fill(store)
    got["refusal"] = str(refusal)
    got["drained"] = t._drain(store)
    got["again"], _ = t._fill(store, 3)
    got["again_drained"] = t._drain(store)
    # something else fills the disk (a checkpoint, logs), then pushes that wait side by side come as one batch
    for task in range(100):
        store.put(t.TABLE, [t._item(4, task)])
    with open(disk / "filler", "wb") as filler:
        try:
            while True:
                filler.write(bytes(1 << 16))
                filler.flush()
        except OSError:
            pass
    outcomes = []
    def push(task):
        try:
            store.put(t.TABLE, [t._item(5, task)])
            outcomes.append("stored")
        except StorageFull:
            outcomes.append("refused")
    go, held = held_writer(store.environment)
    threads = [threading.Thread(target=push, args=(task,)) for task in range(400)]
    for thread in threads:
        thread.start()
    while store.environment.writer._queue.qsize() < len(threads):
        time.sleep(0.01)
    go.set()
    held.result(60)
    for thread in threads:
        thread.join(60)
    got["burst"] = outcomes.count("stored")
    got["burst_drained"] = t._drain(store)
    (disk / "filler").unlink()
    got["after_filler"], _ = t._fill(store, 6)
    got["verify"] = store.verify(t.TABLE)
print(json.dumps(got))
"""


def _namespaces() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in a user namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _namespaces(), reason="no user namespaces here: the full disk needs a tmpfs of its own")
def test_a_full_disk_consumes_to_empty_and_then_takes_pushes_again(tmp_path: Path) -> None:
    mount = tmp_path / "disk"
    mount.mkdir()
    command = ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", _DISK_SCRIPT]
    done = subprocess.run(
        [*command, str(mount), str(Path(__file__).parent)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["stored"] > 300, got
    assert "disk" in got["refusal"] and "kept for consumes" in got["refusal"], got
    assert got["drained"] == got["stored"], got
    assert got["again"] >= got["stored"] // 2 and got["again_drained"] == got["again"], got
    # the burst was refused before it took the pages the file kept: the 100 before it are consumed
    assert got["burst"] < 20 and got["burst_drained"] == 100 + got["burst"], got
    assert got["after_filler"] > 100, got  # the disk has room again: pushes are taken
    assert got["verify"] == [], got


_UPGRADE_SCRIPT = """
import json, os, subprocess, sys
import lmdb
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import StorageFull

disk, fixture = Path(sys.argv[1]), Path(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
data = disk / "data"
data.mkdir()
with lmdb.open(str(fixture), readonly=True, lock=False, max_dbs=64) as env:  # no free page: the upgrade grows it
    env.copy(str(data), compact=True)
(data / "lock.mdb").write_bytes(bytes(4096))  # as LMDB leaves it: its header's page written, the rest sparse
os.truncate(data / "lock.mdb", 8192)

def fill(name):  # something else takes the disk's last bytes
    with open(disk / name, "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(bytes(512))
        except OSError:
            pass

fill("filler")

def opened():
    try:
        Store(data).close()
    except StorageFull as exc:
        return str(exc)
    return None

got = {"size": (data / "data.mdb").stat().st_size, "refusal": opened()}
got["size_after"] = (data / "data.mdb").stat().st_size
(data / "lock.mdb").unlink()  # a directory restored from its data.mdb alone
fill("filler2")
got["no_lock_file"] = opened()
(disk / "filler").unlink()
with Store(data) as store:
    got["tables"] = sorted(t.name for t in store.list_tables())
    got["verify"] = {table: store.verify(table) for table in got["tables"]}
print(json.dumps(got))
"""


@pytest.mark.skipif(not _namespaces(), reason="no user namespaces here: the full disk needs a tmpfs of its own")
def test_an_open_on_a_full_disk_is_refused_saying_so_and_gives_back_what_it_wrote(tmp_path: Path) -> None:
    """Format 3's directory (tests/fixtures/datadir_v3) brought to the current format on a disk with
    no room: the start said only "mdb_txn_commit: Input/output error" and left the data file grown
    by what the failed commit wrote, the disk's last bytes; without its lock file, LMDB's open ended
    the process with SIGBUS (it writes that sparse file through a map). A lock file LMDB made before,
    sparse past its first page, opens as it did (a full store still opens to be emptied)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    fixture = Path(__file__).parent / "fixtures" / "datadir_v3"
    command = ["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", _UPGRADE_SCRIPT]
    done = subprocess.run(
        [*command, str(mount), str(Path(__file__).parent), str(fixture)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-4000:])
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["refusal"] is not None and "from data format 3 to" in got["refusal"], got
    assert "failed writing to its disk (is it full or failing? free: " in got["refusal"], got
    assert "the directory is as it was" in got["refusal"], got
    assert got["size_after"] == got["size"], got
    assert got["no_lock_file"] is not None and "lock file" in got["no_lock_file"] and "is full" in got["no_lock_file"]
    assert got["tables"] and all(found == [] for found in got["verify"].values()), got
