"""Records a data directory lost (server/store/rules/quarantine.py, core/verbs/retire.py): an
experience's record and its payload both gone, a ready group's record gone, a member's record gone
under a group that is evicted or whose lease ends. Each is met by the request that reaches it,
which quarantines what is lost, serves or retires the rest, and leaves the table's counters what
its records say, so `store.verify` finds nothing after it. The damage is made as
tests/test_quarantine.py makes it: a row deleted from one database, as a lost page would."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_quarantine import lose, uids

from expbuf.server.store import Store
from expbuf.server.store.schema.errors import TableFull
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items


def counted(store: Store) -> dict[str, int]:
    stats = store.stats("t")
    return {name: stats[name] for name in ("ready", "leased", "failed", "quarantined", "damaged", "groups_failed")}


def stored_bytes(store: Store, tasks: list[int]) -> int:
    """The bytes of the payloads of these tasks' groups, read back from the store."""
    return sum(map(len, store.get("t", [uid for task in tasks for uid in uids(task)]).values()))


# ---- an experience whose record and payload are both lost ---------------------------------------


def test_a_member_lost_with_its_payload_leaves_the_table_s_bytes_and_a_push_that_fits_is_stored(
    tmp_path: Path,
) -> None:
    """The sample that buries a member whose record and payload are gone takes its bytes out of
    the table's counter: its record said how many, and nothing else does. They stayed counted, so
    Stats showed bytes the table no longer held and a push that fitted was refused as full."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("probe", estimator="none", group_size=4))
        for task in range(4):
            store.put("probe", group_items(0, task, 4, reward=float(task)))
        full = store.stats("probe")["bytes"]
        store.create_table(TableConfig.of("t", estimator="none", group_size=4, capacity_bytes=full))
        for task in range(4):
            store.put("t", group_items(0, task, 4, reward=float(task)), timeout=0)
        lost = uids(1)[2]
        lose(store, "t", lost, "items")
        lose(store, "t", lost, "blobs")
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0), hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/0", "0/2"]
        assert counted(store) == {
            "ready": 4, "leased": 0, "failed": 3, "quarantined": 1, "damaged": 1, "groups_failed": 1,
        }  # fmt: skip
        assert store.stats("t")["bytes"] == stored_bytes(store, [3])
        assert store.verify("t") == []
        # Three groups fit beside the one left, as many as the table held at its fullest.
        for task in range(4, 7):
            store.put("t", group_items(0, task, 4, reward=float(task)), timeout=0)
        assert store.stats("t")["bytes"] == full
        with pytest.raises(TableFull, match="table 't'"):
            store.put("t", group_items(0, 7, 4), timeout=0)
        assert store.verify("t") == []
