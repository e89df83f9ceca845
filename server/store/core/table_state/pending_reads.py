"""A rows table's pending group as it is stored, read without the table's state: its members' rows
from its fragments and head (`pending_rows`, `readable_rows`: the state's, the scrub's and a Get's
readers), and what is left of a group where damage lost its head or rows: its uids under the keys of
its payloads or records, and a member made from its payload alone. With them, the refusal of what an
index names but is not stored (`stored`, `missing`)."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import lmdb

from expbuf.client.schema.routing import uid_group_key

from ...disk import chunk_reads, digests
from ...disk.batch_rows import Reader
from ...disk.kinds import Entry
from ...disk.rows import Member, PendingHead, decode_member_rows, fragment_key
from ...schema.errors import DAMAGE, StoreError, clip


def _uids_begin(gkey: str, by: str) -> str:
    """What every uid of group `gkey` of a table grouped `by` begins with: its key and a '/' where it is
    keyed by task or run, its batch and task where keyed by step (the step comes after the run in a
    uid), the one uid where each experience is its own group."""
    if by == "step":
        return gkey.rsplit("/", 1)[0] + "/"
    return gkey + _AFTER_KEY[by]


# What follows a group's key in its uids, in a table grouped other than by step (_uids_begin).
_AFTER_KEY = {"task": "/", "run": "/", "none": ""}


def _row_parts(
    reader: Reader, dbs: Mapping[str, lmdb._Database], prefix: bytes, gkey: str, head: PendingHead
) -> Iterator[Callable[[], list[Member]]]:
    """A rows table's pending group's rows in push order, part by part: each fragment's, then its
    head's own, each read when called (raising where damage lost or changed it)."""
    for number in range(head.fragments):
        yield functools.partial(_fragment_rows, reader, dbs["frags"], fragment_key(prefix, gkey, number))
    yield head.inline_rows


def _fragment_rows(reader: Reader, frags: lmdb._Database, key: bytes) -> list[Member]:
    return decode_member_rows(stored(reader, key, frags, "fragment"))


def pending_rows(
    reader: Reader, dbs: Mapping[str, lmdb._Database], prefix: bytes, gkey: str, head: PendingHead
) -> list[Member]:
    """A rows table's pending group's members, in push order, as its fragments and then its head hold
    them, read from `reader` (the table state's transaction, or a reader's such as the scrub's or a
    Get's)."""
    return [row for part in _row_parts(reader, dbs, prefix, gkey, head) for row in part()]


def readable_rows(
    reader: Reader, dbs: Mapping[str, lmdb._Database], prefix: bytes, gkey: str, head: PendingHead
) -> list[Member]:
    """`pending_rows`, less those damage lost (a fragment not stored or not decoding, the head's own rows
    not decoding): what a Get serves and a Delete takes out, as a records table's reads pass over a
    member whose record is lost; the members its head names whose rows are not among them stay its,
    for its end to fail it with (TableState.pending_members)."""
    found: list[Member] = []
    for part in _row_parts(reader, dbs, prefix, gkey, head):
        try:
            found.extend(part())
        except DAMAGE:
            continue
    return found


def stored(reader: Reader, key: bytes, db: lmdb._Database, what: str) -> bytes | memoryview:
    """The value of a table's key (its id, then a name) that an index or a record names, so
    it is stored: one that is not is damage, refused by name rather than read as nothing."""
    value = reader.get(key, db=db)
    if value is None:
        raise missing(what, bytes(key[4:]).decode(errors="replace"))
    return value


def missing(what: str, name: str) -> StoreError:
    """The refusal of a record or payload that is named but not stored: the directory is damaged."""
    return StoreError(f"{what} {clip(name)} is named but not stored: run `expbuf check` on the data directory")


def group_uids(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes, by: str, gkey: str) -> list[str]:
    """The uids of group `gkey` (of a table grouped `by`) under the keys of `db` (its payloads', or a
    records table's records), found by what its uids begin with."""
    with txn.cursor(db=db) as cur:
        return list(uids_under(cur, prefix, by, gkey))


def holding_payloads(
    txn: lmdb.Transaction[bytes],
    blobs: lmdb._Database,
    prefix: bytes,
    by: str,
    opened: Sequence[bytes],
    pushed: Mapping[str, Sequence[Entry]],
) -> list[str]:
    """Of the groups a push opens (their directory keys: `prefix` and their key, which a push encodes
    once), those with a payload stored (a seek each, through one cursor, but for those the key a seek
    finds passes: nothing is stored under them): a group whose head is lost while its runs are stored
    (rules/pushes.py). A group keyed by step,
    whose runs' uids are not side by side, is looked for under each run the push brings it
    (`pushed`: a seek a run, a resent run found whatever its suffix)."""
    if not opened:
        return []
    found = []
    with txn.cursor(db=blobs) as cur:
        if by == "step":
            for gkey in (key[len(prefix) :].decode() for key in sorted(opened)):
                runs = sorted({prefix + entry.uid.rsplit("/", 1)[0].encode() + b"/" for entry in pushed[gkey]})
                if any(next(uids_under(cur, prefix, by, gkey, begin), None) for begin in runs):
                    found.append(gkey)
            return found
        seek, key = cur.set_range, cur.key
        end = _AFTER_KEY[by].encode()
        # in key order: the cursor moves on through the leaf pages, a seek a few keys on
        begins = sorted([key + end for key in opened])
        at = 0
        while at < len(begins) and seek(begins[at]):  # none stored from a begin on: none from those after
            begin, stored = begins[at], bytes(key())
            if stored[: len(begin)] == begin:
                gkey = begin[len(prefix) : len(begin) - len(end)].decode()
                if next(uids_under(cur, prefix, by, gkey, begin), None):
                    found.append(gkey)
                at += 1
                continue
            # the begins before the key found that it does not fall under hold nothing: passed over at once
            beyond = bisect.bisect_left(begins, stored, at + 1)
            at = at + 1 if any(map(stored.startswith, begins[at + 1 : beyond])) else beyond
    return sorted(found)


def uids_under(cur: lmdb.Cursor[bytes], prefix: bytes, by: str, gkey: str, begin: bytes | None = None) -> Iterator[str]:
    """The uids of group `gkey` under a cursor's keys (a table's, `prefix` first), found by what they
    begin with (`begin`: all of them, where not given)."""
    begin = prefix + _uids_begin(gkey, by).encode() if begin is None else begin
    more = cur.set_range(begin)
    while more and cur.key()[: len(begin)] == begin:
        uid = bytes(cur.key()[len(prefix) :]).decode(errors="replace")
        if (uid if by == "none" else uid_group_key(uid, by)) == gkey:
            yield uid
        more = cur.next()


def member_from_payload(
    txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, uid: str, created: float
) -> Member:
    """A member made from its payload (under `key`) alone (a digest of zeros and a size of 0 where it
    does not read)."""
    try:
        blob = chunk_reads.read_payload(txn, dbs, key)
    except DAMAGE:
        blob = None
    digest, size = (bytes(16), 0) if blob is None else (digests.of(blob), len(blob))
    return Member(uid, digest, size, 0, created, 0, 0, 0)
