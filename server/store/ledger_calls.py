"""The Store's calls of the prompt ledger: datasets of prompts and the claims on them, answered by
its claims service (services/claims.py, over the ledger's rules, ledger/rules.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .ledger.claimed import Claimed
from .ledger.records import DatasetRecord
from .services.claims import Claims, RecordPage


class LedgerCalls:
    """Mixed into the Store, which makes `claims`."""

    claims: Claims

    def create_dataset(
        self, table: str, ds: DatasetRecord, *, exist_ok: bool = False, stop: Callable[[], bool] | None = None
    ) -> tuple[DatasetRecord, bool]:
        """A dataset of prompts on the table, or a shard's part of one; (record, created)."""
        return self.claims.create(table, ds, exist_ok=exist_ok, stop=stop)

    def datasets(self, table: str, name: str = "", *, by_epoch: bool = True) -> list[DatasetRecord]:
        """The table's datasets (or the one named), with their cursors and totals, and each
        epoch's prompts owned and counts unless not `by_epoch`."""
        return self.claims.datasets(table, name, by_epoch=by_epoch)

    def claim(
        self,
        table: str,
        name: str,
        count: int,
        *,
        seconds: float,
        owner: str = "",
        holder: str = "",
        wait: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[list[Claimed], bool]:
        """Up to `count` prompts under claims that end `seconds` from now; and whether the dataset is done."""
        return self.claims.claim(table, name, count, seconds=seconds, owner=owner, holder=holder, wait=wait, stop=stop)

    def renew_claims(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], seconds: float, *, holder: str = ""
    ) -> tuple[float, list[tuple[int, int, int]]]:
        """Claims (epoch, index, attempt) now end `seconds` from now; when, and those that had ended."""
        return self.claims.renew(table, name, prompts, seconds, holder)

    def release_claims(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], *, holder: str = ""
    ) -> int:
        """Claims given back now: their prompts go out again with attempt + 1."""
        return self.claims.release(table, name, prompts, holder)

    def report_prompts(
        self, table: str, name: str, outcomes: Sequence[tuple[int, int, int, list[float]]], *, holder: str = ""
    ) -> int:
        """Prompts whose groups were trained outside expbuf, with their runs' rewards: trained."""
        return self.claims.report(table, name, outcomes, holder)

    def list_prompts(
        self,
        table: str,
        name: str,
        *,
        states: Sequence[str] = (),
        after: tuple[int, int] | None = None,
        limit: int = 1000,
    ) -> RecordPage:
        """A page of the dataset's prompts handed out at least once."""
        return self.claims.prompts(table, name, states=states, after=after, limit=limit)
