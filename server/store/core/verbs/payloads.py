"""A push's new payloads stored, in push order, and counted pending with their bytes, places in the
insertion order (next_seq) and versions; and payloads leaving with their token-level advantages, a
failed group's kept for Get where a records table's are (`kept`): a records table's and a rows
table's alike (groups.py, rows/pending.py, retire.py, rows/moves.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import cast

from ...disk import chunked, shared_prompts
from ...disk.kinds import Entry
from ...disk.layout import delete_rows, put_rows
from ...schema.states import FAILED, State
from ..table_state.state import TableState


def store(tt: TableState, entries: Sequence[Entry]) -> None:
    """New experiences' payloads, in push order, counted pending with their bytes, places in the
    insertion order (next_seq) and versions: a records table's and a rows table's alike. A push whose
    payloads are all kept as they are (chunked.kept_whole) is stored without a step an experience."""
    counters = tt.counters
    keys = tt.keys([entry.uid for entry in entries])
    blobs = [entry.blob for entry in entries]
    if chunked.kept_whole(blobs, [entry.prompt_bytes for entry in entries]):
        put_rows(tt.txn, tt.db["blobs"], list(zip(keys, blobs, strict=True)))
    else:
        sharing = shared_prompts.Sharing(tt.txn, tt.db)
        stored = chunked.stored_value
        values = [
            stored(sharing, key, e.blob, e.response_length, e.prompt_bytes, e.chunks)
            for key, e in zip(keys, entries, strict=True)
        ]
        sharing.close()
        put_rows(tt.txn, tt.db["blobs"], list(zip(keys, values, strict=True)))
    count, nbytes = len(entries), sum([entry.size for entry in entries])
    versions = [entry.version for entry in entries]
    known = [v for v in versions if v is not None] if None in versions else cast("list[int]", versions)
    counters.pending += count
    counters.next_seq += count
    counters.bytes += nbytes
    counters.bytes_pushed += nbytes
    if known:
        low, high = counters.min_version, counters.max_version
        counters.min_version = min(known) if low is None else min(low, *known)
        counters.max_version = max(known) if high is None else max(high, *known)


def _every(key: bytes) -> bool:
    return True


def kept(tt: TableState, state: State, damaged: Set[str]) -> Callable[[bytes], bool] | bool:
    """Which members' payloads (by key) a rows table's group retiring as `state` keeps, as `drop`
    takes it: a failed group's, with keep_failed or where it failed for `damaged` members (for Get,
    as a records table keeps them: core/verbs/retire.retire), but the damaged ones'; none (False)
    otherwise."""
    if state != FAILED or not (tt.config.retention.keep_failed or damaged):
        return False
    lost = {tt.key(uid) for uid in damaged}
    return lambda key: key not in lost


def drop(
    tt: TableState, keys: Sequence[bytes], sizes: Sequence[int], *, keep: Callable[[bytes], bool] | bool = False
) -> None:
    """Experiences (their keys, their payloads' sizes) leave the live data, a records table's and a
    rows table's alike: their payloads (and chunks: chunked.py; `keep` keeps those of failed
    experiences for Get: all of them, or those it says) and token-level advantages go, one database
    at a time in key order, and their bytes leave the table's. A kept payload goes when its
    tombstone is forgotten (segments.prune, retire.forget_tombstone)."""
    txn = tt.txn
    if keep is False:  # every one goes (a consume's)
        tt.delete_payloads(keys, sizes)
    else:
        keeps = _every if keep is True else keep
        gone = [at for at, key in enumerate(keys) if not keeps(key)]
        tt.delete_payloads([keys[at] for at in gone], [sizes[at] for at in gone])
    if keys and _has_advantages(tt):
        delete_rows(txn, tt.db["adv"], sorted(keys))
    tt.counters.bytes -= sum(sizes)


def _has_advantages(tt: TableState) -> bool:
    """Whether any token-level advantages of this table are stored (none for a table
    without an estimator, so retiring its experiences need not look for them)."""
    with tt.txn.cursor(db=tt.db["adv"]) as cur:
        return cur.set_range(tt.prefix) and cur.key().startswith(tt.prefix)
