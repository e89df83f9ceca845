"""Format 11's step (issue 64, Deliver 4): format 10 kept the members each push added to a rows table's
pending or computing group in a fragment of that group's own (T + the group's key + a zero byte + the
fragment's number, members as rows); format 11 keeps one fragment a request, shared by the groups it
reached, and each head names its members' ranges there (core/table_state/fragments.py); a head keeps
its members' uid hashes as XXH3-64's digests (format 10: the same numbers, little-endian). The upgrade,
in the open's transaction, makes each such group's fragments one fragment of its own, numbered from
its table's next, that its head names whole, and its hashes digests.
"""

from __future__ import annotations

import struct
from collections import defaultdict

import lmdb

from ...disk.rows import (
    PENDING,
    FragmentRef,
    Member,
    PendingHead,
    decode_member_rows,
    encode_count,
    encode_members,
    fragment_count_key,
    fragment_key,
)
from ..table_state.counters import Counters, read_counters, write_counters

_HEAD = struct.Struct("<BBIId")  # format 10's head began as format 11's: kind, flags, members, fragments, created


def upgrade(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
    """Every rows table's pending and computing groups' fragments in format 11's form."""
    if "gdir" not in dbs:  # the directory never held a rows table
        return
    rows: dict[bytes, dict[int, bytes]] = defaultdict(dict)  # T + group key -> its fragments by number
    for key, value in txn.cursor(db=dbs["frags"]):
        rows[bytes(key[:-5])][int.from_bytes(key[-4:], "big")] = bytes(value)
    txn.drop(dbs["frags"], delete=False)
    heads = [(bytes(key), bytes(raw)) for key, raw in txn.cursor(db=dbs["gdir"]) if raw[:1] == bytes([PENDING])]
    counters: dict[bytes, Counters] = {}
    for key, raw in heads:
        kind, flags, count, fragments, created = _HEAD.unpack_from(raw)
        head = PendingHead.decode(_HEAD.pack(kind, flags, count, 0, created) + raw[_HEAD.size :])
        hashes = struct.unpack_from(f"<{count}Q", raw, _HEAD.size)  # XXH3-64's as numbers: its digests
        head.hashed = struct.pack(f">{count}Q", *hashes)
        stored = rows.get(key, {})
        members: list[Member] = []
        for number in range(fragments):
            if number in stored:  # one lost is the check's to find: the head names more members than stay
                members.extend(decode_member_rows(stored[number]))
        if members:
            prefix = key[:4]
            table = counters.get(prefix)
            if table is None:
                table = counters[prefix] = read_counters(txn, dbs, prefix)
            fragment = table.next_fragment
            table.next_fragment += 1
            txn.put(fragment_key(prefix, fragment), encode_members(members), db=dbs["frags"])
            txn.put(fragment_count_key(prefix, fragment), encode_count(1), db=dbs["frags"])
            head.refs = [FragmentRef(fragment, 0, len(members))]
        txn.put(key, head.encode(), db=dbs["gdir"])
    for prefix, table in counters.items():
        write_counters(txn, dbs, prefix, table)
