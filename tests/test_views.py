"""Code outside the table core reads a table's groups and experiences as views (schema/views.py),
never as the records the core keeps (issue 64): it names no record type and calls none of the
table state's record accessors, and the core takes back only a view it made."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from expbuf.server.store.core.table_state.views import group_record, member_record
from expbuf.server.store.disk.records import GroupRecord, ItemRecord

ROOT = Path(__file__).resolve().parent.parent
# The rooms that keep records, and the store's face, which still exports ItemRecord for a release.
OWNERS = ("server/store/core/", "server/store/disk/", "server/store/__init__.py", "server/ray/")
RECORDS = {"GroupRecord", "ItemRecord"}
# TableState's accessors of records (core/table_state/state.py); code outside the core reads view, existing_view,
# member, members and stored_members.
ACCESSORS = {
    "group", "existing_group", "item", "existing_item", "cached_item", "put_item", "put_group", "settle_item",
    "forget_item", "forget_group",
}  # fmt: skip


def readers_of_records(source: str) -> list[str]:
    """What a module's source names of the records: record types imported or read, and calls of a
    table state's (`tt`) record accessors."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"imports {alias.name}" for alias in node.names if alias.name in RECORDS]
        elif isinstance(node, ast.Attribute) and node.attr in RECORDS:
            found.append(f"reads {node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            if isinstance(receiver, ast.Name) and receiver.id == "tt" and node.func.attr in ACCESSORS:
                found.append(f"calls tt.{node.func.attr}")
    return found


def test_outside_the_table_core_no_server_module_reads_records() -> None:
    found = {}
    for path in sorted((ROOT / "server").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if not name.startswith(OWNERS) and (reads := readers_of_records(path.read_text())):
            found[name] = reads
    assert found == {}


@pytest.mark.parametrize(
    "source",
    [
        "from ..disk.records import GroupRecord\n",
        "from ..store import ItemRecord\n",
        "def f(tt):\n    return tt.group('g')\n",
        "def f(tt, uid, rec):\n    tt.put_item(uid, rec)\n",
        "from ..disk import records\nrecords.ItemRecord.decode(b'')\n",
    ],
)
def test_each_way_of_reaching_a_record_is_found(source: str) -> None:
    assert readers_of_records(source)


def test_the_core_takes_back_only_a_view_it_made() -> None:
    grp = GroupRecord(state="pending", created=0.0)
    rec = ItemRecord(
        state="pending", group="g", seq=0, digest=bytes(16), size=1, created=0.0, tid="", rid="", step=0,
        response_length=0, generated=0,
    )  # fmt: skip
    assert group_record(grp) is grp and member_record(rec) is rec
    with pytest.raises(TypeError, match="did not make: ItemRecord"):
        group_record(rec)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="did not make: GroupRecord"):
        member_record(grp)  # type: ignore[arg-type]
