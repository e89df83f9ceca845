"""The rows of a batch read from the store: each experience's payload, item record and
stored advantage, as a sample (leases.take) and a Get (Store.get_payload) read them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import lmdb

from expbuf.client.trxp.stored.pieces import Stored

from ..schema.errors import StoreError
from ..schema.table_config import TableConfig, batch_stage
from ..schema.views import MemberView
from .chunk_reads import Deferred
from .stored_advantages import Advantage, FinishBatch, StageCounts, advantage_of


class Reader(Protocol):
    """What a batch's rows are read from: a read transaction, or a snapshot (snapshot.py)."""

    def get(self, key: bytes, *, db: lmdb._Database) -> bytes | memoryview | None: ...


class BatchRows:
    """A batch being read in one transaction, row by row. The advantages are the stored
    ones; a table with a batch stage finishes them where the reply is built (`stage`), with
    the batch stage the server gave the store (`finish`)."""

    def __init__(
        self,
        txn: Reader,
        adv: lmdb._Database,
        config: TableConfig,
        finish: FinishBatch | None,
    ) -> None:
        self.txn, self.adv, self.config, self.finish = txn, adv, config, finish
        self.computed = config.advantages.estimator != "none"  # a table without an estimator has no advantages
        self.blobs: list[Stored | Deferred] = []
        self.records: list[MemberView] = []
        self.advantages: list[Advantage] = []
        self.nbytes = 0  # the payloads' bytes, as their records say
        self.beside: list[MemberView] = []  # the rest of the batch these rows are part of (add_beside)
        self.beside_advantages: list[Advantage] = []

    def add(self, key: bytes, rec: MemberView, blob: Stored | Deferred) -> None:
        """One experience: its payload (as read), its record and its stored advantage (the
        value in the record, or the token-level record of the `adv` database)."""
        self.blobs.append(blob)
        self.records.append(rec)
        self.nbytes += rec.size
        self.advantages.append(self._advantage(key, rec.advantage, rec.response_length))

    def add_beside(self, key: bytes, rec: MemberView) -> None:
        """An experience of the batch these rows are part of (a leased step, of which they are a
        rank's part), not read: the batch stage finishes the rows over the whole batch, as it was
        sampled, not over the part alone."""
        self.beside.append(rec)
        self.beside_advantages.append(self._advantage(key, rec.advantage, rec.response_length))

    def add_columns(
        self,
        keys: Sequence[bytes],
        blobs: Sequence[Stored | Deferred],
        advantages: Sequence[float | None],
        lengths: Sequence[int],
        sizes: Sequence[int],
        records: Callable[[], Sequence[MemberView]],
    ) -> None:
        """Experiences as `add` has them, given as their records' columns (`advantages`, `lengths`:
        each one's stored advantage and response length; `sizes`), their records (`records`) made
        only where the table's batch stage reads them."""
        self.blobs += blobs
        self.nbytes += sum(sizes)
        if self.computed:
            self.advantages += map(self._advantage, keys, advantages, lengths)
        elif advantages.count(None) == len(advantages):  # none stored at all (no estimator)
            self.advantages += [None] * len(advantages)
        else:  # none stored apart from its record
            self.advantages += map(advantage_of, advantages, lengths, itertools.repeat(None))
        if batch_stage(self.config):
            self.records += records()

    def _advantage(self, key: bytes, advantage: float | None, length: int) -> Advantage:
        """An experience's stored advantage (`advantage`, its record's): the value in its record,
        or the token-level record of the `adv` database."""
        token_level = self.txn.get(key, db=self.adv) if self.computed and advantage is None else None
        return advantage_of(advantage, length, None if token_level is None else bytes(token_level))

    def stage(self, counts: StageCounts | None) -> BoundStage | None:
        """The batch stage still to run on these rows, or None where the table has none. A
        store given no batch stage refuses to take such a batch: its stored values are
        pending, not advantages."""
        if not self.records or not batch_stage(self.config):
            return None
        if self.finish is None:
            raise StoreError(
                f"table {self.config.name!r} finishes its advantages over each sampled batch, "
                "and this store was given no batch stage (Store(batch_stage=...))"
            )
        return BoundStage(self.finish, self.config, self.records, counts, self.beside, self.beside_advantages)


@dataclass
class BoundStage:
    """A table's batch stage bound to a batch's rows (`records`), over the rows of the rest of the
    batch they are part of where they are a rank's part (`beside`), its clip counted in `counts`."""

    finish: FinishBatch
    config: TableConfig
    records: list[MemberView]
    counts: StageCounts | None
    beside: list[MemberView]
    beside_stored: list[Advantage]

    def __call__(self, stored: Sequence[Advantage]) -> list[Advantage]:
        if not self.beside:
            return self.finish(self.config, self.records, stored, self.counts)
        finished = self.finish(self.config, [*self.records, *self.beside], [*stored, *self.beside_stored], self.counts)
        return finished[: len(stored)]

    def raised_over(self, stored: Sequence[Advantage], rows: Sequence[int]) -> Exception | None:
        """What the stage raises over `rows` of the batch alone (uncounted), None where it does not."""
        try:
            self.finish(self.config, [self.records[i] for i in rows], [stored[i] for i in rows], None)
        except Exception as exc:
            return exc
        return None
