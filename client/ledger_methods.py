"""The blocking client's calls of the prompt ledger (BufferClient inherits them): datasets of
prompts, claims on them, outcomes reported, pages of prompts. Each call is described once in
rpc/ledger_calls.py and run by the client's `_run`, as its other calls are."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from .rpc import calls, ledger_calls
from .rpc.connection import ClientBase
from .schema.prompts import Claim, DatasetInfo, Prompt, PromptPage

R = TypeVar("R")


class LedgerMethods(ClientBase):
    """The prompt ledger's calls of the blocking client (client.py)."""

    def _run(self, call: calls.Unary[R]) -> R:
        raise NotImplementedError  # BufferClient runs it

    def create_dataset(
        self, table: str, name: str, size: int, *, exist_ok: bool = False, **settings: Any
    ) -> DatasetInfo:
        """A dataset of `size` prompts (indexes 0..size-1) on a table that groups by task.
        Settings: `epochs` (1), `seed` (each epoch in a permutation fixed by it; None: index
        order), `max_in_flight` (bound on prompts claimed, or generated and not yet trained; 0:
        none), `on_drop` ("done": a group the table drops counts its prompt as done; "retry":
        it goes out again), `max_attempts` (5: a prompt sent back this often is dropped),
        `pass_threshold` (0.0: a run passes when its reward is above it, in each prompt's statistics,
        which `list_prompts` returns), `order` ("permutation"; "pools": by the last group's mean
        reward, easy / medium / hard with shares; "pass_rate": near a target pass rate first) and
        its `order_options`, `zero_variance` ("keep"; "retry": claimed again; "skip": sits out the
        next `skip_epochs` epochs). docs/concepts/prompt-ledger.md shows a curriculum."""
        return self._run(ledger_calls.create_dataset(table, name, size, exist_ok, settings))

    def datasets(self, table: str = "default") -> list[DatasetInfo]:
        """The table's datasets, each with its cursor and its prompts by state and epoch."""
        return self._run(ledger_calls.datasets(table))

    def ledger(self, table: str, dataset: str) -> DatasetInfo:
        """One dataset's settings, cursor and prompts by state and epoch."""
        (info,) = self._run(ledger_calls.datasets(table, dataset))
        return info

    def claim(
        self,
        table: str,
        dataset: str,
        count: int = 1,
        *,
        lease_seconds: float = 300.0,
        owner: str = "",
        wait: float = 0.0,
    ) -> Claim:
        """Up to `count` prompts for this rollout worker, under claims that end `lease_seconds`
        from now unless renewed; prompts sent back go out before new ones. Waits up to `wait`
        seconds when none can be handed out now (max_in_flight reached, or every prompt out),
        asking again while the server has as many claims waiting as it lets (calls.Attempts).
        `done` says the dataset has nothing left to hand out or train. `count` is at most
        MAX_PROMPTS_PER_CALL (expbuf.client.schema.prompts), and at most what one reply holds
        within this client's `max_message_bytes`: a claim of more is refused, before anything
        is claimed, with ResourceExhaustedError (reason `too_large`) naming the count that fits."""
        return self._run(
            ledger_calls.claim(table, dataset, count, lease_seconds, owner, wait, self.timeout, self.max_message_bytes)
        )

    def renew_claims(self, prompts: Iterable[Prompt], seconds: float) -> list[Prompt]:
        """Claims now end `seconds` from now; returns the prompts whose claim had already ended
        (not renewed: their groups will not be taken, give up on them). Any number, in calls of
        at most MAX_PROMPTS_PER_CALL."""
        ended: list[Prompt] = []
        for (table, dataset), part in ledger_calls.by_dataset(prompts):
            ended += self._run(ledger_calls.renew_claims(table, dataset, part, seconds))[1]
        return ended

    def release_claims(self, prompts: Iterable[Prompt]) -> int:
        """Give claims back now: each prompt goes out again with its next attempt. Returns the
        claims that were still held. Any number, in calls of at most MAX_PROMPTS_PER_CALL."""
        return sum(
            self._run(ledger_calls.release_claims(table, dataset, part))
            for (table, dataset), part in ledger_calls.by_dataset(prompts)
        )

    def report_prompts(self, outcomes: ledger_calls.Outcomes) -> int:
        """Prompts whose groups were generated and trained outside expbuf (a framework's own queue
        held their runs), each with its runs' rewards (`{prompt: [rewards]}` or pairs): each
        prompt still claimed is trained, its statistics taking the rewards, so a claim order
        learns from them. Returns the prompts whose claims still held. A prompt whose group is in
        the table is refused (AlreadyExistsError): its group's events move it."""
        return sum(
            self._run(ledger_calls.report_prompts(table, dataset, part))
            for (table, dataset), part in ledger_calls.outcomes_by_dataset(outcomes)
        )

    def list_prompts(
        self,
        table: str,
        dataset: str,
        *,
        states: Iterable[str] = (),
        after: tuple[int, int] | None = None,
        limit: int = 1000,
    ) -> PromptPage:
        """A page of the dataset's prompts handed out at least once, in (epoch, index) order, of
        `states` (all when empty); pass the page's `after` for the next."""
        return self._run(ledger_calls.list_prompts(table, dataset, states, after, limit))
