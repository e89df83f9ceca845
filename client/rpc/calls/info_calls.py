"""What the buffer says of itself as the clients ask it (InfoCalls, declared once: rpc/declare.py):
each table's counts (Stats), and the server's version, storage and device (ServerInfo)."""

from __future__ import annotations

from expbuf.proto.v1 import buffer_pb2 as pb

from ...results import BufferStats, ServerInfo, TableStats
from ..declare import ClientSettings, Plan, Unary, declare


class InfoCalls(ClientSettings):
    """The calls of the buffer's stats and the server's info, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: s._stats)
    def stats(self, table: str = "") -> Plan[BufferStats]:
        """Counts by state, bytes, groups, totals, trainer version and shaping counts of one table,
        or of every table when `table` is empty, each a TableStats by table name:

        ```python
        ready = client.stats("grpo8")["grpo8"].ready
        ```

        Sharded: each table's stats merged over the shards that answer (TableStats.merged);
        `.missing` names the others."""

        def read(reply: pb.StatsReply) -> BufferStats:
            return BufferStats({t.name: TableStats.from_proto(t) for t in reply.tables})

        return Unary("Stats", pb.StatsRequest(table=table), read, retry=True)

    @declare(shards=lambda s: s._server_info)
    def server_info(self) -> Plan[ServerInfo]:
        """The server's version, uptime, storage and map use, and the device advantages run on.
        Sharded: the answering shards' infos combined, each in `.shards`; `.missing` names the
        others."""
        return Unary("ServerInfo", pb.ServerInfoRequest(), ServerInfo.from_proto, retry=True)
