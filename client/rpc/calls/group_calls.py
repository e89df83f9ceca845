"""A table's pending groups settled without a push, as the clients settle them (GroupCalls,
declared once: rpc/declare.py): runs reported failed, each one of its group's runs (a group whose
runs are all known completes short, or is dropped), and a group sealed with the runs it has."""

from __future__ import annotations

from collections.abc import Iterable

from expbuf.proto.v1 import buffer_pb2 as pb

from ...results import FailedRuns
from ...schema.call_limits import MAX_NAMES_PER_CALL
from ..declare import ClientSettings, Plan, Several, Unary, declare

FAILED_FIELDS = ("recorded", "completed_groups", "dropped_groups")  # FailedRuns', in order


class GroupCalls(ClientSettings):
    """The calls that settle a table's pending groups, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: s._fail_runs)
    def fail_runs(
        self, uids: Iterable[str], table: str = "default", *, reasons: Iterable[str] = ()
    ) -> Plan[FailedRuns]:
        """Report runs that will never be pushed (their rollouts failed), by the uids they would
        have had, with a reason each (kept in the group's record) or none. Each counts as one of
        its group's runs: a group whose runs are then all known completes short with the members
        present, its advantages computed over them, when at least the table's min_group_size
        succeeded; otherwise it is dropped. A run pushed later after all rejoins its group. Any
        number, in calls of at most MAX_NAMES_PER_CALL (expbuf.client.schema.call_limits).

        Sharded: each run on the shard that owns its group; a shard that did not answer or refused
        raises ShardError, its `result` what the others did."""
        # Not retried by the channel: a report that completed or dropped a group, sent again,
        # finds the group complete (FAILED_PRECONDITION) or opens it anew.
        uids, reasons = list(uids), list(reasons)
        if reasons and len(reasons) != len(uids):
            raise ValueError(f"fail_runs: {len(uids)} uids for {len(reasons)} reasons: one reason a uid, or none")
        most = MAX_NAMES_PER_CALL
        requests = [
            pb.FailRunsRequest(table=table, uids=uids[start : start + most], reasons=reasons[start : start + most])
            for start in (range(0, len(uids), most) if uids else range(1))
        ]

        def read(reply: pb.FailRunsReply) -> FailedRuns:
            return FailedRuns(list(reply.recorded_uids), list(reply.completed_groups), list(reply.dropped_groups))

        def joined(parts: list[FailedRuns]) -> FailedRuns:
            return FailedRuns(*([one for part in parts for one in getattr(part, name)] for name in FAILED_FIELDS))

        return Several([Unary("FailRuns", request, read, retry=False) for request in requests], joined)

    @declare(shards=lambda s: s._seal)
    def seal(self, group_id: str, table: str = "default") -> Plan[int]:
        """Complete a pending group now, with the runs it has; its advantages are computed over them.
        Returns the group's size. Sharded: on the shard that owns the group."""
        return Unary("Seal", pb.SealRequest(table=table, group_id=group_id), lambda r: r.size, retry=False)
