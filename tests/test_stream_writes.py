"""What a consume stream writes per batch, as counts (bench/bench_writes.py counts them, over a
real Store): the take that holds a batch writes its groups' records (leased) and leaves the ready
order; the confirm, in the next take's commit, consumes it: the payloads, live records and places
in the insertion order go, each member's compact tombstone and its group's consumed record and
retired mark are written. Nothing is written per member that the layout does not need. A table
keeps every ready-group index (index_builds.py says why): each group taken leaves the priority
and version indexes, and the uniform slots, whose freed slots take the groups of the last ones.
A rows table (issue 64) writes a state row a segment and a run row a run instead."""

from __future__ import annotations

import collections
import dataclasses
import sys
from pathlib import Path

import pytest

from expbuf.server.store import Sampled, Store
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


SPEC = TakeSpec("t", batch_size=BATCH, wait_seconds=0)


def held_first(store: Store, group: int, layout: str) -> tuple[collections.Counter[str], Sampled]:
    """Table t of `layout` filled with four pushes of BATCH in groups of `group`, then a first batch
    held: the writes counted from then on, and the batch."""
    config = TableConfig.of("t", estimator="none", group_size=group, drop_zero_variance=False)
    store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout)))
    for at in range(0, 4 * BATCH, BATCH):
        store.put_entries("t", entries(BATCH, group, at))
    counted: collections.Counter[str] = collections.Counter()
    counting(store, counted)
    first = store.sample(SPEC, hold=True)
    assert first is not None
    return counted, first


def records_writes(groups: int) -> tuple[dict[str, int], dict[str, int]]:
    """A records table's writes: a take's, and a confirm's with the next take's."""
    take = {"put groups": groups, **leaves_ready(groups), "put leases": 1, "put counters": 1}
    return take, {
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


def rows_writes(groups: int) -> tuple[dict[str, int], dict[str, int]]:
    """A rows table's (issue 64): no record per member or group. A take writes its segment's state row
    once and cuts the one run it took from (pushes of BATCH make segments of BATCH members, of 64
    groups at most, so a batch of BATCH is one run, whole: a push of 8 groups or more makes its own,
    core/verbs/rows/segments.GROW_BELOW); a confirm writes the state again, deletes
    the payloads and names the segment, all of whose groups retired, in the retired index, and takes
    it out of the index of the oldest live (it holds none)."""
    take = {"put sstate": 1, "del runs": 1, "put leases": 1, "put counters": 1}
    return take, {
        "del leases": 1,
        "del blobs": BATCH,
        "put retired": 1,
        "del oldest": 1,
        "put sstate": 2,
        "del runs": 1,
        "put leases": 1,
        "put counters": 2,
    }


@pytest.mark.parametrize("layout", ["records", "rows"])
@pytest.mark.parametrize("group", [1, 8])
def test_a_consume_stream_writes_per_batch_what_the_layout_needs_and_no_more(
    tmp_path: Path, group: int, layout: str
) -> None:
    take, confirm_and_take = (records_writes if layout == "records" else rows_writes)(BATCH // group)
    with Store(tmp_path) as store:
        counted, first = held_first(store, group, layout)
        assert +counted == take
        counted.clear()
        second = store.sample(SPEC, hold=True, confirm=first.lease_id)  # delivers the first
        assert second is not None
        assert +counted == confirm_and_take
        assert store.stats("t")["consumed"] == BATCH and store.stats("t")["leased"] == BATCH
        assert store.verify("t") == []
