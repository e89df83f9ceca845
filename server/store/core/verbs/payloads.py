"""A push's new payloads stored, in push order, and counted pending with their bytes, places in the
insertion order (next_seq) and versions: a records table's and a rows table's alike (groups.py,
row_pending.py); and a rows table's retiring members' payloads dropped, or kept where their group
failed and a records table's would keep them (`kept`, `drop`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set

from ...disk import chunked, shared_prompts
from ...disk.kinds import Entry
from ...disk.layout import put_rows
from ...schema.states import FAILED, State
from ..table_state.state import TableState


def store(tt: TableState, by_group: Mapping[str, Sequence[Entry]]) -> None:
    """New experiences' payloads, in push order, counted pending with their bytes, places in the
    insertion order (next_seq) and versions: a records table's and a rows table's alike."""
    counters = tt.counters
    prefix, nbytes, count = tt.prefix, 0, 0
    blobs: list[tuple[bytes, bytes]] = []
    versions: list[int] = []
    sharing = shared_prompts.Sharing(tt.txn, tt.db)
    for members in by_group.values():
        for entry in members:
            key = prefix + entry.uid.encode()
            value = chunked.stored_value(
                sharing, key, entry.blob, entry.response_length, entry.prompt_bytes, entry.chunks
            )
            blobs.append((key, value))
            if entry.version is not None:
                versions.append(entry.version)
            nbytes += entry.size
            count += 1
    sharing.close()
    put_rows(tt.txn, tt.db["blobs"], blobs)
    counters.pending += count
    counters.next_seq += count
    counters.bytes += nbytes
    counters.bytes_pushed += nbytes
    if versions:
        low, high = counters.min_version, counters.max_version
        counters.min_version = min(versions) if low is None else min(low, *versions)
        counters.max_version = max(versions) if high is None else max(high, *versions)


def kept(tt: TableState, state: State, damaged: Set[str]) -> Callable[[str], bool]:
    """Which members' payloads a group retiring as `state` keeps: a failed group's, with keep_failed
    or where it failed for `damaged` members (for Get, as a records table keeps them:
    core/verbs/retire.retire), but the damaged ones'; none otherwise."""
    if state != FAILED or not (tt.config.retention.keep_failed or damaged):
        return lambda uid: False
    return lambda uid: uid not in damaged


def drop(
    tt: TableState, uids: Sequence[str], keys: Sequence[bytes], sizes: Sequence[int], keep: Callable[[str], bool]
) -> None:
    """Retiring members (their uids, payload keys and sizes) leave the live bytes; their payloads go, in
    key order, but those `keep` keeps (a tombstone pruned later drops them: segments.prune)."""
    gone = sorted((key, size) for uid, key, size in zip(uids, keys, sizes, strict=True) if not keep(uid))
    chunked.delete(tt.txn, tt.db, [key for key, _ in gone], [size for _, size in gone])
    tt.counters.bytes -= sum(sizes)
