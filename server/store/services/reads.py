"""Reads of stored experiences by uid (Get, `expbuf export`) or by page (ListExperiences).

Reading is verifying: each payload is checked against the digest taken at push before it is
returned, and one that does not match is quarantined (quarantine.py, in the writer's
transaction, through `quarantine`) and left out, as is an experience that cannot be served
(read_check.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from expbuf.client.trxp.pieces import whole

from ..disk import layout
from ..disk.batch_rows import BatchRows
from ..disk.chunked import checked, read_payload
from ..disk.environment import Environment
from ..disk.records import ItemRecord
from ..disk.stored_advantages import FinishBatch, batch_payload
from ..rules.read_check import payload_problem, serve_problem
from ..rules.table_state import stored
from ..tables import browse
from ..tables.catalog import TableCatalog

log = logging.getLogger("expbuf.store")


class Reads:
    """Reads over a data directory's environment and table catalog; `quarantine(table, uids)`
    quarantines those of uids whose payload is damaged (Store.quarantine), `finish` is the
    batch stage the server gave the store."""

    def __init__(
        self,
        environment: Environment,
        catalog: TableCatalog,
        quarantine: Callable[[str, Sequence[str]], int],
        finish: FinishBatch | None,
    ) -> None:
        self.environment, self.catalog, self._quarantine, self.finish = environment, catalog, quarantine, finish

    def get(self, table: str, uids: Sequence[str]) -> dict[str, bytes]:
        """Stored payloads among uids (live experiences', and failed ones' kept for Get), each
        checked against its digest first: a damaged one is quarantined (quarantine.py), not returned."""
        prefix = layout.table_prefix(self.catalog.lookup(table)[0])
        found, damaged = {}, []
        with self.environment.read() as txn:
            for uid in uids:
                key = prefix + uid.encode()
                blob = read_payload(txn, self.environment.db, key)
                if blob is None:
                    continue
                rec = ItemRecord.decode(stored(txn, key, self.environment.db["items"], "experience"))
                if payload_problem(uid, rec, blob) is None:
                    found[uid] = bytes(whole(blob))
                else:
                    damaged.append(uid)
        if damaged:
            self._quarantine(table, damaged)
        return found

    def page(
        self,
        table: str,
        *,
        states: Sequence[str] = (),
        min_version: int | None = None,
        max_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> browse.Page:
        """A page of the table's live experiences in insertion order (see browse.py)."""
        prefix = layout.table_prefix(self.catalog.lookup(table)[0])
        with self.environment.read() as txn:
            return browse.page(
                txn, self.environment.db, prefix,
                states=set(states), min_version=min_version, max_version=max_version, after=after, limit=limit,
            )  # fmt: skip

    def payload(self, table: str, uids: Sequence[str]) -> tuple[bytes, list[str]]:
        """A TRXP batch of the stored experiences among uids (in their order), and the missing
        uids. An experience that cannot be served (read_check.py) is never returned: it is
        listed as missing, and one whose payload is damaged is quarantined (quarantine.py)."""
        table_id, config = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        missing, damaged = [], []
        with self.environment.read(buffers=True) as txn:  # views, copied once: into the batch
            rows = BatchRows(txn, self.environment.db["adv"], config, self.finish)
            for uid in uids:
                key = prefix + uid.encode()
                blob = read_payload(txn, self.environment.db, key)
                if blob is None:
                    missing.append(uid)
                    continue
                rec = ItemRecord.decode(stored(txn, key, self.environment.db["items"], "experience"))
                problem = serve_problem(uid, rec, blob)
                if problem is not None:
                    if problem.damaged:
                        damaged.append(uid)
                    else:
                        log.error("table %s: Get found %s; it is not served", table, problem)
                    missing.append(uid)
                    continue
                rows.add(key, rec, blob)
            stage = rows.stage(None)  # a Get is not a sample: its clip is not counted
            advantages = rows.advantages if stage is None else stage(rows.advantages)
            payload = batch_payload(checked(rows.blobs), advantages)
        if damaged:
            self._quarantine(table, damaged)
        return payload, missing
