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

from helpers import held_writer, make_experience, take

TABLE = "t"


def _item(batch: int, task: int) -> trxp.RawItem:
    return trxp.from_experience(make_experience(batch, task, 0, response=500, prompt=500))


def _fill(store: Store, batch: int = 1) -> tuple[int, StorageFull]:
    """Experiences of about 4 KB (of `batch`) pushed one a push until the store refuses one; (stored, refusal)."""
    for task in range(100_000):
        try:
            store.put(TABLE, [_item(batch, task)])
        except StorageFull as exc:
            return task, exc
    raise AssertionError("100,000 experiences fitted")


def _drain(store: Store) -> int:
    """Consume every group, 8 a take while there are 8; how many experiences."""
    taken = 0
    for groups in (8, 1):
        while (batch := take(store, TABLE, num_groups=groups, delivery="consume", wait_seconds=0)) is not None:
            taken += len(batch.group_ids)
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


def test_a_consume_in_the_batch_of_a_push_the_full_map_refuses_is_committed(tmp_path: Path) -> None:
    """The writer runs a push and a consume waiting side by side in one transaction: where the push
    finds the map full, the consume is run again without it, and commits."""
    with Store(tmp_path, map_size=1 << 20, max_map_size=2 << 20) as store:
        store.create_table(TableConfig.of(TABLE, estimator="none", group_by="none"))
        stored, _ = _fill(store)
        outcomes: dict[str, object] = {}

        def push() -> None:
            try:
                store.put(TABLE, [_item(2, task) for task in range(8)])
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
import json, subprocess, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import TableConfig
import test_full_store as t

data = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(data)], check=True)
with Store(data / "data") as store:
    store.create_table(TableConfig.of(t.TABLE, estimator="none", group_by="none"))
    stored, refusal = t._fill(store)
    drained = t._drain(store)
    again, _ = t._fill(store, 3)
    print(json.dumps({"stored": stored, "refusal": str(refusal), "drained": drained, "again": again,
                      "again_drained": t._drain(store), "verify": store.verify(t.TABLE)}))
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
    assert got["stored"] > 500, got
    assert "disk" in got["refusal"] and "kept for consumes" in got["refusal"], got
    assert got["drained"] == got["stored"], got
    assert got["again"] >= got["stored"] // 2 and got["again_drained"] == got["again"], got
    assert got["verify"] == [], got
