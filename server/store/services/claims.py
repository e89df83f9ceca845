"""The claims service of a Store: a table's datasets of prompts, claims with their wait for a
prompt, renewals, releases and listings, each in the writer's transaction (the rules are
ledger.py's). A claim that finds nothing to hand out waits, as a sample waits for data,
until a prompt comes back, room frees under max_in_flight, the dataset is done, or its time
is up.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, field
from typing import TypeVar

import lmdb

from expbuf.client.schema.call_limits import MAX_LEASE_SECONDS, MAX_REWARDS
from expbuf.client.schema.prompts import MAX_CLAIM_ID_BYTES, MAX_PROMPTS_PER_CALL

from ..core.table_state.state import TableState
from ..disk.environment import Environment
from ..ledger.claimed import Claimed, ClaimStep
from ..ledger.hand_out import STEP_HASHES
from ..ledger.prompt_stats import KeptStats, read_stats
from ..ledger.records import (
    DatasetRecord,
    PromptRecord,
    dataset_key,
    read_dataset,
    read_datasets,
    read_epochs,
    read_prompts,
)
from ..ledger.rules import Ledger
from ..ledger.settings import check, no_dataset
from ..ledger.shards import count_part, count_parts
from ..ledger.states import PROMPT_STATES
from ..schema.errors import Cancelled, InvalidRequest, NotFound, check_names, clip
from ..schema.sample_spec import MAX_WAIT_SECONDS, check_seconds
from ..tables.catalog import TableCatalog

T = TypeVar("T")
MAX_PAGE = 10000
# A claim's owner is stored in each prompt it claims and repeated in the replies that show them:
# a name for the claimant (a host, a pod, a process), not data.
MAX_OWNER_BYTES = 256


def check_claim(count: int, owner: str, wait: float, claim_id: str = "") -> None:
    """Refuse a claim's count, owner, wait or id out of range, naming it and its bound (before it
    claims anything; the service checks its request's with it before it bounds the wait)."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PROMPTS_PER_CALL:
        raise InvalidRequest(f"count is {count!r}; a claim asks for 1 to {MAX_PROMPTS_PER_CALL} prompts")
    if len(owner.encode()) > MAX_OWNER_BYTES:
        raise InvalidRequest(
            f"owner is {len(owner.encode())} bytes; a claim's owner is at most {MAX_OWNER_BYTES} bytes of UTF-8"
        )
    check_seconds("wait_seconds", wait, low=0.0, high=MAX_WAIT_SECONDS)
    if len(claim_id.encode()) > MAX_CLAIM_ID_BYTES:
        raise InvalidRequest(
            f"claim_id is {len(claim_id.encode())} bytes; a claim's id is at most {MAX_CLAIM_ID_BYTES} bytes of UTF-8"
        )


def check_refs(prompts: Sized, call: str) -> None:
    """Refuse a renewal or a release naming more prompts than one call may (before it looks one
    up: the writer is held while it does)."""
    check_names(prompts, "prompts", call, MAX_PROMPTS_PER_CALL)


def shown_owner(owner: str) -> str:
    """An owner as replies show it: one stored before owners were bounded is cut to the bound."""
    return owner.encode()[:MAX_OWNER_BYTES].decode(errors="ignore")


def _dropped(table: str) -> NotFound:
    return NotFound(
        f"table '{clip(table)}' was dropped while the claim went on (a table made again under its name is"
        " another): the prompts it claimed went with it; claim again"
    )


class _Unchanged(Exception):
    """A claim's step that handed out nothing and left its dataset as it was: its transaction is
    undone (a commit would wake every caller that waits for a change, this claim among them)."""

    def __init__(self, step: ClaimStep) -> None:
        super().__init__("nothing to hand out")
        self.step = step


@dataclass(frozen=True)
class RecordPage:
    """One page of a dataset's prompt records in (epoch, index) order; `after` names the last."""

    prompts: list[tuple[int, int, PromptRecord]]
    after: tuple[int, int] | None
    done: bool
    stats: dict[int, KeptStats] = field(default_factory=dict)  # each listed prompt's, by index


class Claims:
    """Datasets and claims over a data directory's environment and table catalog."""

    def __init__(
        self, environment: Environment, catalog: TableCatalog, ledger: Ledger, mark: Callable[[int], None]
    ) -> None:
        self.environment, self.catalog, self.ledger, self._mark = environment, catalog, ledger, mark

    def _in_table(self, table: str, fn: Callable[[TableState], T], table_id: int | None = None) -> T:
        """`fn` of the table's state in the writer's transaction; with `table_id`, of that table
        alone: one dropped (and made again under its name) since is NotFound."""
        try:
            found, config = self.catalog.lookup(table)
        except NotFound:
            if table_id is None:
                raise
            raise _dropped(table) from None  # and not made again yet: the claim began in it all the same
        if table_id is not None and found != table_id:
            raise _dropped(table)

        def op(txn: lmdb.Transaction[bytes]) -> T:
            if table_id is not None and self.catalog.stored_id(txn, table) != table_id:
                raise _dropped(table)
            self._mark(found)  # the upkeep ends the table's claims when their time comes
            tt = self.catalog.state(txn, found, config)
            result = fn(tt)
            tt.save()
            return result

        return self.environment.submit(op)

    def create(
        self, table: str, ds: DatasetRecord, *, exist_ok: bool = False, stop: Callable[[], bool] | None = None
    ) -> tuple[DatasetRecord, bool]:
        """A dataset on the table (ledger.check names a setting out of range); (record with its
        epochs read, created).

        A shard's part of a sharded dataset's first epoch is counted here, before the write, so
        the writer is not held meanwhile (a later epoch's when a claim reaches it); `stop` is
        polled while counting (a cancelled call)."""
        table_id, config = self.catalog.lookup(table)
        check(ds, config.grouping.by)
        if ds.shards:
            with self.environment.read() as txn:
                exists = read_dataset(txn, self.catalog.db["ledger"], table_id, ds.name) is not None
            if not exists:
                ds.owned = [count_part(ds, 0, stop)]

        def create(tt: TableState) -> tuple[DatasetRecord, bool]:
            record, created = self.ledger.create(tt, ds, exist_ok=exist_ok)
            return read_epochs(tt.txn, tt.db["ledger"], tt.table_id, record), created

        return self._in_table(table, create)

    def datasets(self, table: str, name: str = "", *, by_epoch: bool = True) -> list[DatasetRecord]:
        """The table's datasets (or the one named), their cursors and totals, and unless not
        `by_epoch` each epoch's prompts owned and counts (a read per epoch with an event)."""
        table_id, _ = self.catalog.lookup(table)
        db = self.catalog.db["ledger"]
        # Reads take no table state: one (it refers to itself) would keep its transaction's LMDB
        # reader slot until a garbage collection, and a scrape reads every table's datasets.
        with self.environment.read() as txn:
            if name:
                found = read_dataset(txn, db, table_id, name)
                if found is None:
                    raise no_dataset(table, name)
                records = [found]
            else:
                records = read_datasets(txn, db, table_id)
            return [read_epochs(txn, db, table_id, ds) for ds in records] if by_epoch else records

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
        claim_id: str = "",
    ) -> tuple[list[Claimed], bool]:
        """Up to `count` prompts (ledger.claim), waiting up to `wait` for one while the dataset
        is not done; `stop` is polled while waiting or counting (a cancelled call). A claim
        whose cursor spent its share of a transaction (ledger.STEP_HASHES) goes on in the
        next, the writer let go in between; one whose cursor reached an epoch whose part (a
        shard's) is not counted counts it here, with the epochs after it that as many hashes
        count, and goes on with them. A step that fails after earlier ones claimed prompts (a full
        map, a failing disk) answers with those, which are durable and held for the caller, and
        the dataset as not done: the failure meets the caller's next call. Raised, it would leave
        them claimed by a caller that never learned which they were. A claim made again under its
        `claim_id` answers what the first handed out and still holds (ledger.claim)."""
        check_claim(count, owner, wait, claim_id)
        check_seconds("lease_seconds", seconds, low=0.0, high=MAX_LEASE_SECONDS, low_open=True)
        deadline = time.monotonic() + wait
        claimed: list[Claimed] = []
        parts: dict[int, int] = {}
        waited = False
        table_id, _ = self.catalog.lookup(table)  # each step of this table: not one made again under its name
        while True:
            if waited and stop is not None and stop():  # gone while it waited: nothing claimed for no one
                return claimed, False
            generation = self.environment.generation
            claim = functools.partial(self.ledger.claim, name=name, count=count - len(claimed), seconds=seconds,
                                      owner=owner, holder=holder, parts=parts, claim_id=claim_id,
                                      first=not claimed)  # fmt: skip
            try:
                step = self._in_table(table, functools.partial(self._step, name=name, claim=claim), table_id)
            except _Unchanged as unchanged:
                step = unchanged.step
            except NotFound:  # the table or the dataset went: so did the claims of the steps before
                raise
            except Exception:
                if claimed:
                    return claimed, False
                raise
            claimed += step.claimed
            if step.again:
                return claimed, step.done
            stopped = stop is not None and stop()
            if step.uncounted is not None and not stopped:  # counted outside the writer, then on
                try:
                    (ds,) = self.datasets(table, name, by_epoch=False)
                    parts = count_parts(ds, step.uncounted, STEP_HASHES, stop)
                except Cancelled:
                    return claimed, step.done
                except Exception:
                    if claimed:
                        return claimed, False
                    raise
                continue
            if step.more and not stopped:  # its share of the writer spent: it goes on in another transaction
                continue
            if claimed or step.done or time.monotonic() >= deadline or stopped:
                return claimed, step.done
            self.environment.wait_for_change(generation, deadline, poll=True)
            waited = True

    @staticmethod
    def _step(tt: TableState, name: str, claim: Callable[[TableState], ClaimStep]) -> ClaimStep:
        """One transaction of a claim (`claim`: ledger.claim's); _Unchanged where it handed out nothing
        and left the dataset's record as it was (no claim of the dataset ended, its cursor did not
        move): a claim that waits looks again after the next change, and writes nothing meanwhile.
        The claims of the table's other datasets that the step ended go with it: the upkeep ends them."""
        key, db = dataset_key(tt.table_id, name), tt.db["ledger"]
        before = tt.txn.get(key, db=db)
        step = claim(tt)
        if not (step.claimed or step.more or step.done) and step.uncounted is None and tt.txn.get(key, db=db) == before:
            raise _Unchanged(step)
        return step

    def renew(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], seconds: float, *, holder: str = ""
    ) -> tuple[float, list[tuple[int, int, int]]]:
        """Claims now end `seconds` from now (ledger.renew); when, and those that had ended."""
        check_refs(prompts, "RenewClaims")
        check_seconds("lease_seconds", seconds, low=0.0, high=MAX_LEASE_SECONDS, low_open=True)
        return self._in_table(table, lambda tt: self.ledger.renew(tt, name, prompts, seconds, holder))

    def release(self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], *, holder: str = "") -> int:
        """Claims given back now (ledger.release); returns how many were still held."""
        check_refs(prompts, "ReleaseClaims")
        return self._in_table(table, lambda tt: self.ledger.release(tt, name, prompts, holder))

    def report(
        self, table: str, name: str, outcomes: Sequence[tuple[int, int, int, list[float]]], *, holder: str = ""
    ) -> int:
        """Prompts trained outside expbuf, with their runs' rewards (ledger.report); returns how
        many claims still held. A reward that is not a finite number, or a prompt without one, is
        refused by name before the writer is taken."""
        check_refs(outcomes, "ReportPrompts")
        for epoch, index, _, rewards in outcomes:
            check_names(rewards, "a prompt's rewards", "ReportPrompts", MAX_REWARDS)
            if not rewards or not all(math.isfinite(reward) for reward in rewards):
                raise InvalidRequest(
                    f"prompt {clip(name)}/{epoch}/{index}: rewards are {clip(list(rewards))}; a report gives each"
                    " prompt the rewards of its runs, one finite number or more"
                )
        return self._in_table(table, lambda tt: self.ledger.report(tt, name, outcomes, holder))

    def prompts(
        self,
        table: str,
        name: str,
        *,
        states: Sequence[str] = (),
        after: tuple[int, int] | None = None,
        limit: int = 1000,
    ) -> RecordPage:
        """A page of the dataset's prompts handed out at least once, in (epoch, index) order,
        of the given states (all when empty), reading at most `limit` records."""
        check_names(states, "states", "ListPrompts", len(PROMPT_STATES))
        unknown = [state for state in states if state not in PROMPT_STATES]
        if unknown:
            raise InvalidRequest(f"states {unknown!r}: expected some of {', '.join(PROMPT_STATES)}")
        wanted = set(states)
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidRequest(f"limit is {limit}; a page reads 1 to {MAX_PAGE} prompts")
        table_id, _ = self.catalog.lookup(table)
        with self.environment.read() as txn:  # no table state, as in datasets()
            db = self.catalog.db["ledger"]
            if read_dataset(txn, db, table_id, name) is None:
                raise no_dataset(table, name)
            read = list(read_prompts(txn, db, table_id, name, after, limit))
            kept = [row for row in read if not wanted or row[2].state in wanted]
            stats = {index: read_stats(txn, db, table_id, name, index) for _, index, _ in kept}
        last = (read[-1][0], read[-1][1]) if read else after
        return RecordPage(kept, last, len(read) < limit, stats)
