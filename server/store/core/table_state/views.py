"""The records behind the views the table core hands out (schema/views.py): today a view is its
record, and the core, the only code that changes records, takes the record back from a view it
made to change it.
"""

from __future__ import annotations

from ...disk.records import GroupRecord, ItemRecord
from ...schema.views import GroupView, MemberView


def group_record(view: GroupView) -> GroupRecord:
    """The record behind a group's view, for the core to change."""
    if not isinstance(view, GroupRecord):
        raise TypeError(f"a group view the table core did not make: {type(view).__name__}")
    return view


def member_record(view: MemberView) -> ItemRecord:
    """The record behind an experience's view, for the core to change."""
    if not isinstance(view, ItemRecord):
        raise TypeError(f"an experience's view the table core did not make: {type(view).__name__}")
    return view
