"""What a consume stream writes per batch, as counts (bench/bench_writes.py counts them, over a
real Store): the take that holds a batch writes its groups' records (leased) and leaves the ready
order; the confirm, in the next take's commit, consumes it: the payloads, live records and places
in the insertion order go, each member's compact tombstone and its group's consumed record and
retired mark are written. Nothing is written per member that the layout does not need. A table
keeps every ready-group index (index_builds.py says why): each group taken leaves the priority
and version indexes, and the uniform slots, whose freed slots take the groups of the last ones."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from expbuf.server.store import Store
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_writes import counting, entries

BATCH = 64


def leaves_ready(groups: int) -> dict[str, int]:
    """What the groups a take holds write as they leave the ready indexes: a row each of the ready
    order, the priority and the version index deleted, and as many slots freed at the end of the
    uniform slots, the groups moved from there written (and the count)."""
    return {
        "del ready": groups,
        "del prio": groups,
        "del byver": groups,
        "del slots": groups,
        "put slots": groups + 1,
        "put slotof": groups,
    }


@pytest.mark.parametrize("group", [1, 8])
def test_a_consume_stream_writes_per_batch_what_the_layout_needs_and_no_more(tmp_path: Path, group: int) -> None:
    groups = BATCH // group
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=group, drop_zero_variance=False))
        for at in range(0, 4 * BATCH, BATCH):
            store.put_entries("t", entries(BATCH, group, at))
        counted: collections.Counter[str] = collections.Counter()
        counting(store, counted)
        spec = TakeSpec("t", batch_size=BATCH, wait_seconds=0)
        first = store.sample(spec, hold=True)
        assert first is not None
        assert +counted == {"put groups": groups, **leaves_ready(groups), "put leases": 1, "put counters": 1}
        counted.clear()
        second = store.sample(spec, hold=True, confirm=first.lease_id)  # delivers the first
        assert second is not None
        assert +counted == {
            # the first batch consumed
            "del leases": 1,
            "del blobs": BATCH,
            "del items": BATCH,
            "del order": BATCH,
            "put tombs": BATCH,
            "put retired": groups,
            # the second taken, and each group's record written once by each
            **leaves_ready(groups),
            "put groups": 2 * groups,
            "put leases": 1,
            "put counters": 2,
        }
        assert store.stats("t")["consumed"] == BATCH and store.stats("t")["leased"] == BATCH
        assert store.verify("t") == []
