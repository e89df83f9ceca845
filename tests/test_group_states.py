"""The group state machine (server/store/schema/states.py): one table of allowed moves, checked
where every move of a group goes through (TableState.move_group). Each forbidden move is
tried inside a real Store's push transaction: it raises IllegalMove, and the push stores
nothing."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from expbuf.server.store import Pushed, Store, TableExtension
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk.records import GroupRecord
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import LIVE, MOVES, RETIRED, STATES, IllegalMove, State, check_move
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items

ALLOWED = [(was, to) for was, to in itertools.product(State, State) if to in MOVES[was]]
FORBIDDEN = [(was, to) for was, to in itertools.product(State, State) if to not in MOVES[was]]


class Mover(TableExtension):
    """Moves each pushed group, as if it were in `was`, to `to`, when set."""

    def __init__(self) -> None:
        self.move: tuple[State, State] | None = None

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        if self.move is not None:
            was, to = self.move
            for gkey in event.gkeys:
                tt.move_group(gkey, GroupRecord(state=was, created=tt.now), to)


def test_the_table_covers_every_state_and_a_tombstone_never_moves() -> None:
    assert set(MOVES) == set(State) == set(STATES) == {*LIVE, *RETIRED}
    assert all(not MOVES[state] for state in RETIRED)
    assert all(MOVES[state] for state in LIVE)  # every live group can leave
    assert all(State.FAILED in MOVES[state] for state in LIVE)  # a damaged payload fails a group in any
    assert (State.PENDING, State.LEASED) in FORBIDDEN and (State.LEASED, State.EVICTED) in FORBIDDEN


@pytest.mark.parametrize(("was", "to"), ALLOWED)
def test_an_allowed_move_passes(was: State, to: State) -> None:
    check_move("g", was, to)


def test_every_forbidden_move_fails_its_transaction_and_stores_nothing(tmp_path: Path) -> None:
    with Store(tmp_path / "data", extensions={"mover": Mover}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["mover"]))
        (mover,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Mover))
        for n, (was, to) in enumerate(FORBIDDEN):
            mover.move = (was, to)
            with pytest.raises(IllegalMove, match=f"cannot move from {was} to {to}"):
                store.put("t", group_items(n, 0, 2))
            stats = store.stats("t")
            assert (stats["pushed"], stats["ready"], stats["groups_pending"]) == (0, 0, 0), (was, to)
        mover.move = None  # the store is healthy: the next push and sample go through
        store.put("t", group_items(0, 0, 2))
        batch = store.sample(TakeSpec("t", num_groups=1))
        assert batch is not None and len(batch.uids) == 2
        batch.release()
    assert len(FORBIDDEN) == len(State) ** 2 - len(ALLOWED) > 40
