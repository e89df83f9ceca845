"""The rows of a batch read from the store: each experience's payload, item record and
stored advantage, as a sample (leases.take) and a Get (Store.get_payload) read them."""

from __future__ import annotations

import lmdb

from ..advantage_storage import Advantage, BatchStage, StageCounts, stored_advantage
from ..tables import TableConfig
from .records import ItemRecord


class BatchRows:
    """A batch being read in one transaction, row by row. The advantages are the stored
    ones; a table with a batch stage finishes them where the reply is built (`stage`)."""

    def __init__(self, txn: lmdb.Transaction[bytes | memoryview], adv: lmdb._Database, config: TableConfig) -> None:
        self.txn, self.adv, self.config = txn, adv, config
        self.computed = config.estimator != "none"  # a table without an estimator has no advantages
        self.blobs: list[bytes | memoryview] = []
        self.records: list[ItemRecord] = []
        self.advantages: list[Advantage] = []

    def add(self, key: bytes, rec: ItemRecord, blob: bytes | memoryview) -> None:
        """One experience: its payload (as read), its record and its stored advantage (the
        value in the record, or the token-level record of the `adv` database)."""
        token_level = self.txn.get(key, db=self.adv) if self.computed and rec.advantage is None else None
        self.blobs.append(blob)
        self.records.append(rec)
        self.advantages.append(stored_advantage(rec, None if token_level is None else bytes(token_level)))

    def stage(self, counts: StageCounts | None) -> BatchStage | None:
        """The batch stage still to run on these rows, or None where the table has none."""
        return BatchStage.of(self.config, self.records, counts)
