"""The rows a table keeps per batch of groups, not per experience (issue 64, format 10): written and
read only by the table core (core/), the one owner of a table's records.

- members.py: a block of members' columns (`Member`, `encode_members`, `MemberBlock`), which a
  segment and a fragment of pending groups' members hold, and format 10's fragments' members as rows
  (`decode_member_rows`), which its upgrade reads;
- segments.py: a segment of completed groups (`Group`, `encode_segment`, `SegmentView`) and what
  changes of it (`SegState`);
- directory.py: the group directory's entries (`GroupRef`, encoded a segment's at once: `group_refs`;
  `PendingHead`, `directory_entry`, `uid_hashes`), the ranges of fragments a head names (`FragmentRef`),
  and the keys of fragments and of their count rows (`fragment_key`, `fragment_count_key`);
- runs.py: the runs the ready orders keep (`RunRow`) and a lease of runs (`RowLease`).

May import the disk room's records (their numbers and strings, a lease's head) and the schema.
"""

from .directory import (
    PENDING,
    REF,
    FragmentRef,
    GroupRef,
    PendingHead,
    decode_count,
    directory_entry,
    encode_count,
    fragment_count_key,
    fragment_key,
    group_refs,
    uid_hashes,
)
from .members import ROWS, Member, MemberBlock, decode_member_rows, encode_members
from .runs import RowLease, RunRow, decode_lease
from .segments import SEGMENT_GROUPS, SEGMENT_MEMBERS, Group, SegmentView, SegState, encode_segment

__all__ = [
    "PENDING", "REF", "ROWS", "SEGMENT_GROUPS", "SEGMENT_MEMBERS", "FragmentRef", "Group", "GroupRef", "Member",
    "MemberBlock", "PendingHead", "RowLease", "RunRow", "SegState", "SegmentView", "decode_count", "decode_lease",
    "decode_member_rows", "directory_entry", "encode_count", "encode_members", "encode_segment",
    "fragment_count_key", "fragment_key", "group_refs", "uid_hashes",
]  # fmt: skip
