"""A group must fit in one Sample reply: one that could never be sent is refused at the push
that would make it so, and nothing of that push is stored.

A batch holds whole groups, so a group larger than the server's `max_message_bytes` in a
reply would be stored and then fail every sample, blocking fifo delivery at the head of its
table. The size of a group's reply is bounded from what is known at push: each member's stored
payload, the advantages and returns a sample adds (two float32 tensors of the response length),
their header entries, the member's uid twice (uids, group ids), and the reply's own framing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..disk.kinds import Entry
from ..rules.table_state import TableState
from ..schema.errors import TooLarge, clip

REPLY_FRAMING = 4096  # the batch's TRXP header and the reply's other fields, lease id included
MEMBER_FRAMING = 256  # a member's tensor header entries and field tags


def member_bytes(size: int, response_length: int, uid: str) -> int:
    """The most one stored experience adds to a Sample reply."""
    return size + 8 * response_length + MEMBER_FRAMING + 2 * len(uid.encode())


def check(tt: TableState, entries: Sequence[Entry], limit: int | None) -> None:
    """Refuse (TooLarge, naming the limit) a push after which a group would not fit in a reply of `limit` bytes."""
    if limit is None:
        return
    added: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    for entry in entries:
        if entry.uid in seen or tt.item(entry.uid) is not None:  # a duplicate adds nothing
            continue
        seen.add(entry.uid)
        added[entry.group_key(tt.config.grouping.by)] += member_bytes(len(entry.blob), entry.response_length, entry.uid)
    for gkey, new in added.items():
        if REPLY_FRAMING + new <= limit and not _stored_members(tt, gkey):
            continue
        total = REPLY_FRAMING + new + _stored_bytes(tt, gkey)
        if total > limit:
            raise TooLarge(
                f"group {clip(gkey)} would take {total} bytes in a Sample reply, above the server's "
                f"max_message_bytes = {limit}: it could never be delivered, so the push is refused and nothing of "
                "it is stored (push smaller experiences, or raise max_message_bytes on the server and the clients)"
            )


def _stored_members(tt: TableState, gkey: str) -> list[str]:
    grp = tt.group(gkey)
    return [] if grp is None else grp.members


def _stored_bytes(tt: TableState, gkey: str) -> int:
    total = 0
    for uid in _stored_members(tt, gkey):
        rec = tt.item(uid)
        if rec is not None:
            total += member_bytes(rec.size, rec.response_length, uid)
    return total
