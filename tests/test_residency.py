"""The server's resident memory does not grow with its data file (server/store/disk/residency.py): the
map pages a full open check or a scrub pass read are given back, so the data file's share of the
process's RSS (its mapping's `Rss` in /proc/self/smaps) stays a small part of the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from expbuf.client import EID, Experience, trxp
from expbuf.server.store import Entry, Store
from expbuf.server.store.core.ordering import ready as core_ready
from expbuf.server.store.disk import layout, residency
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.services import index_builds

from helpers import wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")


def entries(n: int, start: int, size: int = 0) -> list[Entry]:
    """n experiences of a group each, of about `size` bytes (small when 0): bench/bench_writes.py's
    entries, their payloads byte for byte, with the tokens made a tensor once rather than
    converted from a list of ints for each experience (4 s of the 12,000 of 8 KB's 5 s)."""
    tokens = torch.arange(8 + size // 4)
    return [
        Entry.of(
            trxp.from_experience(
                Experience(
                    eid=EID(batch=0, task=i, run=0, suffix=f"s{start}"),
                    tokens=tokens,
                    prompt_length=4,
                    reward=float(i % 2),
                    info={"model_version": 1},
                )
            )
        )
        for i in range(start, start + n)
    ]


def resident(path: Path) -> int:
    """Bytes of this process's maps of `path` that are resident now."""
    ranges = residency.mapped(path)
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, _, end = head.partition("-")
            inside = (int(start, 16), int(end, 16)) in ranges
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of about 100 MB: 12,000 experiences of 8 KB."""
    path = tmp_path_factory.mktemp("resident") / "data"
    with Store(path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=1, drop_zero_variance=False))
        for start in range(0, 12_000, 1_000):
            store.put_entries("t", entries(1_000, start, size=8_000))
    return path


def test_a_full_open_check_and_a_scrub_pass_leave_the_file_out_of_rss(data: Path) -> None:
    size = (data / "data.mdb").stat().st_size
    assert size > 90e6
    with Store(data, check_at_open="full") as store:  # reads every payload through the map
        after_open = resident(data / "data.mdb")
        assert store.scrub.run_pass() == 0
        after_pass = resident(data / "data.mdb")
        with store.environment.read() as txn:  # a read of its own, given back by nobody: it stays
            for _, blob in txn.cursor(db=store.db["blobs"]):
                assert blob
        read_whole = resident(data / "data.mdb")
    assert read_whole > size / 2  # what a pass over the file leaves resident when nothing gives it back
    assert after_open < size / 10 and after_pass < size / 10


@pytest.mark.usefixtures("records_layout")  # a records table's build from the open, of its group records
def test_a_build_of_an_index_from_the_open_leaves_the_file_out_of_rss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table an earlier release made lacks its priority index; the open builds it in the
    background from every ready group's record (index_builds.py), which touches pages all over the
    file; they are given back when the build ends, as after a scrub pass. The builds go at full
    pace (BUILD_SHARE 1: no pause after a chunk, which would double their time here and changes
    nothing of what they read or give back)."""
    monkeypatch.setattr(index_builds, "BUILD_SHARE", 1.0)
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=1, drop_zero_variance=False))
        table_id, _ = store.catalog.lookup("t")
        prefix, db = layout.table_prefix(table_id), store.environment.db
        store.environment.submit(lambda txn: core_ready.mark_in_use(txn, db, prefix, set()))  # as made before
        for start in range(0, 50_000, 10_000):  # 67 MB; the build gives its pages back 3 times on the way
            store.put_entries("t", entries(10_000, start))
    size = (tmp_path / "data.mdb").stat().st_size
    with Store(tmp_path) as store:
        wait_for(lambda: store.index_builds() == [], "the builds from the open", 600)
        batch = store.sample(TakeSpec("t", num_groups=1, order="priority", delivery="replay", wait_seconds=0))
        assert batch is not None and batch.group_ids == ["0/0"]
        after_build = resident(tmp_path / "data.mdb")
        with store.environment.read() as txn:  # the same records read again, given back by nobody
            assert sum(1 for _ in txn.cursor(db=store.db["groups"])) == 50_000
        read_again = resident(tmp_path / "data.mdb")
    assert read_again > size / 10  # what the build's reads leave resident when nothing gives them back
    assert after_build < size / 50
