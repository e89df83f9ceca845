"""Tables as the clients administer them (TableCalls, declared once: rpc/declare.py): created (from
a preset or settings), listed and dropped, and experiences and groups deleted from one."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Unpack

from expbuf.proto.v1 import buffer_pb2 as pb

from ...results import TableInfo
from ...schema.call_limits import MAX_NAMES_PER_CALL, in_parts
from ...schema.table_presets import with_preset
from ...schema.table_settings import TableSettings
from .. import wire
from ..declare import ClientSettings, Plan, Several, Unary, declare, warn_caller


class TableCalls(ClientSettings):
    """The calls of tables and their contents, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: s._delete)
    def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> Plan[int]:
        """Remove experiences by uid and whole groups by id, with their records, so they may be pushed again
        (admin scope), in calls of at most MAX_NAMES_PER_CALL uids and as many groups
        (expbuf.client.schema.call_limits). Returns how many experiences were removed.

        Sharded: on every shard, the experiences removed over all of them; a shard that did not
        answer or refused raises ShardError, its `result` what each of the others removed, by shard."""
        uid_parts, group_parts = in_parts(list(uids), MAX_NAMES_PER_CALL), in_parts(list(groups), MAX_NAMES_PER_CALL)
        requests = [
            pb.DeleteRequest(table=table, uids=some_uids, group_ids=some_groups)
            for some_uids, some_groups in itertools.zip_longest(uid_parts, group_parts, fillvalue=())
        ]
        return Several([Unary("Delete", request, lambda r: r.deleted, retry=False) for request in requests], sum)

    @declare(shards=lambda s: s._create_table)
    def create_table(
        self, name: str, *, exist_ok: bool = False, preset: str | None = None, **settings: Unpack[TableSettings]
    ) -> Plan[TableInfo]:
        """Create a table; settings use the names of a TOML `[[tables]]` block (group_by, group_size,
        estimator, capacity_experiences, capacity_bytes, when_full, shaping, ...):

        ```python
        client.create_table("grpo8", group_size=8, estimator="grpo", exist_ok=True)
        ```

        `preset` starts from a common table's settings (`queue`, `replay`, `trinity`: see
        docs/concepts/tables.md), the settings given over them; it is expanded here, so the
        server gets plain settings:

        ```python
        client.create_table("replay", preset="replay", capacity_experiences=100_000, min_size_to_sample=1024)
        ```

        With exist_ok, a table of the same settings is returned as it is, and one of other settings
        is refused (AlreadyExistsError) naming each setting that differs. An unknown preset, or one
        without the settings it needs, is a ValueError naming them. `capacity`, the old name of
        capacity_experiences, is still read in this release, with a FutureWarning.

        Sharded: on every shard (exist_ok makes a retry after a partial failure safe); with
        exist_ok, a shard that does not answer is owed the table, created the next time it
        answers, and the table returned names it in `.missing`."""
        flat = with_preset(preset, settings)
        if "capacity" in flat:  # the old name, read for one more release
            if "capacity_experiences" in flat:
                raise ValueError("create_table got both capacity and capacity_experiences: pass capacity_experiences")
            warn_caller(
                "create_table: capacity is the old name of capacity_experiences, the setting's name everywhere else;"
                " pass capacity_experiences (capacity is refused from the next release)",
                FutureWarning,
            )
            flat["capacity_experiences"] = flat.pop("capacity")
        request = pb.CreateTableRequest(config=wire.table_to_proto({"name": name, **flat}), exist_ok=exist_ok)
        return Unary("CreateTable", request, _table_info, retry=False)

    @declare(shards=lambda s: s._list_tables)
    def list_tables(self) -> Plan[list[TableInfo]]:
        """Every table's settings, under the names of a TOML `[[tables]]` block. Sharded: as the
        first shard that answers holds them."""

        def read(reply: pb.ListTablesReply) -> list[TableInfo]:
            return [TableInfo.from_settings(wire.table_from_proto(t)) for t in reply.tables]

        return Unary("ListTables", pb.ListTablesRequest(), read, retry=True)

    @declare(shards=lambda s: s._drop_table)
    def drop_table(self, name: str) -> Plan[int]:
        """Drop a table with every experience, group, lease and counter in it (admin scope).
        Returns how many experiences it held. Sharded: on every shard, the experiences it held
        over all of them; a shard that did not answer or refused raises ShardError, its `result`
        what each of the others dropped, by shard."""
        return Unary("DropTable", pb.DropTableRequest(name=name), lambda r: r.dropped_experiences, retry=False)


def _table_info(reply: pb.CreateTableReply) -> TableInfo:
    return TableInfo.from_settings(wire.table_from_proto(reply.config))
