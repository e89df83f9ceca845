"""The prompt state machine (server/store/ledger/states.py): one table of allowed moves, checked
where every move of a prompt goes through (PromptRecord.move). Every forbidden move is tried, one
inside a real Store's push transaction: it raises IllegalPromptMove and the push stores nothing;
the docs' diagram of a prompt's life draws exactly the table."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.server.store import Pushed, Store, TableExtension
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.ledger.records import DatasetRecord, PromptRecord, prompt_key
from expbuf.server.store.ledger.states import (
    DONE,
    PROMPT_MOVES,
    PROMPT_STATES,
    IllegalPromptMove,
    PromptState,
    check_prompt_move,
)
from expbuf.server.store.schema.table_config import TableConfig

from helpers import make_experience

ALLOWED = [(was, to) for was, to in itertools.product(PromptState, PromptState) if to in PROMPT_MOVES[was]]
FORBIDDEN = [(was, to) for was, to in itertools.product(PromptState, PromptState) if to not in PROMPT_MOVES[was]]
DOCS = Path(__file__).resolve().parent.parent / "docs/concepts/prompt-ledger.md"


def test_the_table_covers_every_state_and_a_done_prompt_never_moves() -> None:
    assert set(PROMPT_MOVES) == set(PromptState) == set(PROMPT_STATES)
    assert all(not PROMPT_MOVES[state] for state in DONE)
    assert all(PROMPT_MOVES[state] for state in PromptState if state not in DONE)  # every live prompt can end
    assert (PromptState.PENDING, PromptState.GENERATED) in FORBIDDEN  # a prompt is claimed before it is generated
    assert (PromptState.TRAINED, PromptState.PENDING) in FORBIDDEN
    assert len(FORBIDDEN) == len(PromptState) ** 2 - len(ALLOWED) > 15


def test_the_docs_diagram_draws_the_table() -> None:
    drawn = set(re.findall(r"^\s+(\w+) --> (\w+)", DOCS.read_text(), re.M))
    assert drawn == {(str(was), str(to)) for was, to in ALLOWED}


@pytest.mark.parametrize(("was", "to"), ALLOWED)
def test_an_allowed_move_passes(was: PromptState, to: PromptState) -> None:
    check_prompt_move("p", was, to)
    record = PromptRecord(was, 0)
    record.move(to, "p")
    assert record.state == to


@pytest.mark.parametrize(("was", "to"), FORBIDDEN)
def test_a_forbidden_move_raises_and_leaves_the_record(was: PromptState, to: PromptState) -> None:
    record = PromptRecord(was, 0)
    with pytest.raises(IllegalPromptMove, match=f"prompt math/0/1 cannot move from {was} to {to}"):
        record.move(to, "math/0/1")
    assert record.state == was


class Mover(TableExtension):
    """Moves the prompt `where`'s stored record, as if it were in `was`, to `to`, at each push."""

    def __init__(self) -> None:
        self.move: tuple[PromptState, PromptState] | None = None
        self.where = ("math", 0, 0)

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        if self.move is None:
            return
        was, to = self.move
        key = prompt_key(tt.table_id, *self.where)
        record = PromptRecord.decode(tt.txn.get(key, db=tt.db["ledger"]))
        record.state = was
        record.move(to, "/".join(map(str, self.where)))
        tt.txn.put(key, record.encode(), db=tt.db["ledger"])


def test_every_forbidden_move_in_a_request_fails_its_transaction_and_stores_nothing(tmp_path: Path) -> None:
    with Store(tmp_path / "data", extensions={"mover": Mover}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["mover"]))
        (mover,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Mover))
        store.claims.create("t", DatasetRecord("math", size=4))
        (prompt,), _ = store.claims.claim("t", "math", 1, seconds=60)
        runs = [
            trxp.from_experience(make_experience(f"math/{prompt.epoch}", f"{prompt.index}@{prompt.attempt}", run))
            for run in range(2)
        ]
        before = store.claims.datasets("t", "math")[0].totals
        for was, to in FORBIDDEN:
            mover.move = (was, to)
            with pytest.raises(IllegalPromptMove, match=f"cannot move from {was} to {to}"):
                store.put("t", runs)
            assert store.stats("t")["pushed"] == 0, (was, to)
            page = store.list_prompts("t", "math").prompts
            assert [(index, record.state) for _, index, record in page] == [(prompt.index, "claimed")], (was, to)
            assert store.claims.datasets("t", "math")[0].totals == before
        mover.move = None  # the store is healthy: the claimant's push completes the group, the prompt is generated
        store.put("t", runs)
        (ds,) = store.claims.datasets("t", "math")
        assert (ds.total("claimed"), ds.total("generated")) == (0, 1)
        assert store.verify("t") == []
