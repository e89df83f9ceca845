"""The rows a table keeps per batch of groups, not per experience (issue 64, formats 10 and 11): written and
read only by the table core (core/), the one owner of a table's records.

- members.py: a block of members' columns (`Member`, `encode_members`, `MemberBlock`), which a
  segment holds, and members as rows (`encode_member_rows`, the first one's time alone:
  `first_created`), which a pending group's head and fragments hold;
- segments.py: a segment of completed groups (`Group`, `encode_segment`, `SegmentView`, grown by
  the groups completed after it while none of its own moved: `append_groups`) and what changes of
  it (`SegState`);
- directory.py: the group directory's entries (`GroupRef`, encoded a segment's at once: `group_refs`;
  `PendingHead`, `directory_entry`, one group's: `group_entry`, `uid_hash`) and a pending group's
  fragments' keys (`fragment_key`);
- runs.py: the runs the ready orders keep (`RunRow`) and a lease of runs (`RowLease`).

May import the disk room's records (their numbers and strings, a lease's head) and the schema.
"""

from .directory import (
    PENDING,
    REF,
    GroupRef,
    PendingHead,
    directory_entry,
    fragment_key,
    group_entry,
    group_refs,
    uid_hash,
    uid_hashes,
)
from .members import (
    ROWS,
    Member,
    MemberBlock,
    decode_member_rows,
    encode_member_rows,
    encode_members,
    first_created,
    member_rows,
)
from .runs import RowLease, RunRow, decode_lease
from .segments import (
    SEGMENT_GROUPS,
    SEGMENT_MEMBERS,
    Group,
    SegmentView,
    SegState,
    agreeing,
    append_groups,
    encode_segment,
)

__all__ = [
    "PENDING", "REF", "ROWS", "SEGMENT_GROUPS", "SEGMENT_MEMBERS", "Group", "GroupRef", "Member", "MemberBlock",
    "PendingHead", "RowLease", "RunRow", "SegState", "SegmentView", "agreeing", "append_groups", "decode_lease",
    "decode_member_rows", "directory_entry", "encode_member_rows", "encode_members", "encode_segment",
    "first_created", "fragment_key", "group_entry", "group_refs", "member_rows", "uid_hash", "uid_hashes",
]  # fmt: skip
