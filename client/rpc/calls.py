"""The buffer's calls as the clients make them, and what every call of the service needs.

Each call of the buffer's experiences, leases, trainer versions, admission and tables is declared
once here (BufferCalls, rpc/declare.py): its parameters, docstring, what it sends and how its
reply is read; the four clients get their methods from it. Here too: how a call is made again
after a refusal that did nothing (`Attempts`), a push's payload and its messages, and the Sample
stream's pieces (confirmations, batches), whose two loops are each client's own.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, Generic, TypeVar, Unpack

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from .. import trxp
from ..columns import decode_columns
from ..errors import DataLossError, DeadlineExceededError, ExpbufError
from ..results import (
    Batch,
    BufferStats,
    FailedRuns,
    Grant,
    Leases,
    PushResult,
    ServerInfo,
    TableInfo,
    TableStats,
)
from ..schema.call_limits import MAX_NAMES_PER_CALL, in_parts
from ..schema.experience import EID
from ..schema.table_presets import with_preset
from ..schema.table_settings import TableSettings
from ..trxp.column_batch import wire as column_wire
from ..trxp.column_batch.build import ColumnBatch
from . import frames, wire
from .connection import BACKOFF
from .declare import Chunked, ClientSettings, Plan, Several, Unary, declare, warn_caller
from .sample_reply import SampleReplyParts

R = TypeVar("R")
T = TypeVar("T")
B = TypeVar("B", bound=Batch)
# How long a stream the caller left may take to hand back the batches already on their way.
STOP_SECONDS = 5.0
# What the client keeps of a batch's confirm_seconds for its confirmation's way to the server:
# a tenth of it, at most this.
CONFIRM_MARGIN = 2.0


class Attempts(Generic[R]):
    """The attempts of one call, `call` the next. The server lets only so many calls wait at once
    (each holds a server thread while it waits) and refuses the others at once, as having done
    nothing (ExpbufError.busy). Such a refusal of a call that waits there is not its caller's
    answer: the call is made again after a pause, as gRPC's retry policy pauses
    (connection.BACKOFF). A claim or an admit with a `wait` (its request's wait_seconds) waits
    what is left of it; once its wait is spent, it is made once more without waiting, so that it
    answers with what there is. A push, which waits for room in a full table in block mode, or
    for the rate limit (or, as a PutValues does, for max_inflight_bytes), is made as it was: it
    stored nothing, and is stored once however often it is sent. No attempt ends past the first
    one's deadline (the call's timeout, else the client's `timeout`); the refusal that comes when
    none may start before it is the caller's."""

    def __init__(self, call: Unary[R] | Chunked[R], timeout: float) -> None:
        self.call = call
        start = time.monotonic()
        self._pushes = isinstance(call, Chunked) or call.method in ("Push", "PutValues")
        self._waits_until = start + _wait(call)
        self._deadline = start + (call.timeout or timeout)
        self._made = 0  # attempts made again

    def after(self, error: ExpbufError) -> float | None:
        """The pause before the call is made again (`call` is then that attempt), or None when
        `error` is the call's answer."""
        call = self.call
        if error.code == grpc.StatusCode.UNIMPLEMENTED and isinstance(call, Unary) and call.fallback is not None:
            self.call = replace(call.fallback, timeout=call.timeout)
            return 0.0
        waits = _wait(call) > 0  # not once it is made without waiting
        if not (error.busy and (waits or self._pushes)):
            return None
        now = time.monotonic()
        pause = BACKOFF.pause(self._made)
        self._made += 1
        if waits:
            pause = max(0.0, min(pause, self._waits_until - now))
        start = now + pause
        if start >= self._deadline:
            return None
        if isinstance(call, Unary) and waits:
            request = type(call.request)()
            request.CopyFrom(call.request)
            request.wait_seconds = max(0.0, self._waits_until - start)
            call = replace(call, request=request)
        self.call = replace(call, timeout=self._deadline - start)
        return pause


def _wait(call: Unary[Any] | Chunked[Any]) -> float:
    """The seconds `call` asks the server to wait (a claim's or an admit's wait_seconds), 0 for none."""
    return float(getattr(call.request, "wait_seconds", 0.0)) if isinstance(call, Unary) else 0.0


def one_reply(replies: list[Any], method: str = "PushStream") -> Any:
    """The reply to a push sent in chunks, or to a ReadFields once put together: its stream answers it once."""
    if len(replies) != 1:
        raise ExpbufError(grpc.StatusCode.INTERNAL, f"{method} answered one call {len(replies)} times")
    return replies[0]


FAILED_FIELDS = ("recorded", "completed_groups", "dropped_groups")  # FailedRuns', in order


# What a push takes: TRXP bytes, a ColumnBatch, or experiences (expbuf's or Trinity-RFT's).
Items = bytes | ColumnBatch | Iterable[Any]


PUSH_TAKES = "push takes TRXP bytes, a ColumnBatch or a list of experiences (expbuf's Experience or Trinity-RFT's)"


def payload(items: Items) -> bytes:
    """TRXP bytes as they are, a ColumnBatch's payload, or experiences (expbuf's or Trinity-RFT's)
    encoded; anything else a TypeError saying what a push takes (the codec would fail on it
    deep inside, reading an `eid` a dict's key or a string's letter has not)."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        return bytes(items)
    if isinstance(items, ColumnBatch):
        return items.payload
    if hasattr(items, "eid"):
        raise TypeError(f"{PUSH_TAKES}, got one {type(items).__name__}: push a list of it ([experience])")
    if isinstance(items, (str, Mapping)) or not isinstance(items, Iterable):
        fields = " (a dict of fields goes in a ColumnBatch, or Experience(**fields))"
        raise TypeError(f"{PUSH_TAKES}, got {type(items).__name__}{fields if isinstance(items, Mapping) else ''}")
    experiences = list(items)
    for index, item in enumerate(experiences):
        if not hasattr(item, "eid"):
            raise TypeError(f"{PUSH_TAKES}; item {index} is a {type(item).__name__}, which has no eid")
    return trxp.encode(experiences)


def payload_uids(body: bytes) -> tuple[str, ...]:
    """The uids of a push's payload, TRXP or columns; TrxpError for one that is neither."""
    if column_wire.is_columns(body):
        return tuple(EID(**eid).uid for eid in column_wire.read(body).eids)
    return tuple(item.uid for item in trxp.parse(body))


def _version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    return version


def push(items: Items, table: str, timeout: float | None, chunk_bytes: int) -> Unary[PushResult] | Chunked[PushResult]:
    """One Push, or a PushStream of chunks of `chunk_bytes` for a payload larger (0: never): the
    call of BufferCalls.push."""

    body = payload(items)
    if 0 < chunk_bytes < len(body):
        most = frames.most_push_request(chunk_bytes, table)
        return Chunked(lambda: push_requests(body, table, chunk_bytes), push_result, True, timeout, message_bytes=most)
    return Unary("Push", frames.push_request(body, table), push_result, retry=True, timeout=timeout)


def push_result(reply: pb.PushReply) -> PushResult:
    return PushResult(
        list(reply.stored_uids),
        list(reply.duplicate_uids),
        list(reply.completed_groups),
        list(reply.stale_uids),
        list(reply.partial_uids),
    )


def push_requests(body: bytes, table: str, size: int, seq: int = 0) -> Iterator[bytes]:
    """The PushStream messages of one push, serialised (frames.py): whole, or in chunks of `size`
    (0: whole) when larger, each copied once, from the payload into its message."""
    if not 0 < size < len(body):
        yield frames.push_request(body, table, seq=seq)
        return
    view = memoryview(body)
    yield frames.push_request(view[:size], table, seq=seq, total_bytes=len(body))
    for start in range(size, len(body), size):
        yield frames.push_request(view[start : start + size])


class BufferCalls(ClientSettings):
    """The calls of the buffer's experiences, leases, trainer versions, admission and tables, as
    the clients make them (rpc/declare.py); its reads, keyed values and prompt ledger are in
    read_calls.py, value_calls.py and ledger_calls.py."""

    @declare(shards=lambda s: s._push)
    def push(self, items: Items, table: str = "default", *, timeout: float | None = None) -> Plan[PushResult]:
        """Store TRXP bytes, experiences (expbuf's or Trinity-RFT's) or a ColumnBatch; durable when it returns.
        A retried push is safe: what was stored already comes back in `duplicates`. A payload
        larger than the client's `push_chunk_bytes` goes in chunks over one PushStream. A full table
        in block mode makes it wait for room until its deadline, asking again while the server has
        as many calls waiting as it lets (calls.Attempts).

        Sharded: each group's part goes to the shard that owns it, the parts in parallel; a shard
        that failed raises ShardError, its `result` what the others stored."""
        return push(items, table, timeout, self.push_chunk_bytes)

    @declare(shards=lambda s: partial(s._end, method="ack"))
    def ack(self, lease_id: str, table: str = "default") -> Plan[int]:
        """Consume the groups of a lease (of `table`, taken with this client's token).
        Returns the experiences it held. Sharded: on the shards that leased them."""
        return Unary("Ack", pb.AckRequest(table=table, lease_id=lease_id), lambda r: r.acked, retry=False)

    @declare(shards=lambda s: partial(s._end, method="nack"))
    def nack(self, lease_id: str, table: str = "default") -> Plan[int]:
        """Return the groups of a lease to the buffer now. Returns the experiences it held.
        Sharded: to the buffers of the shards that leased them."""
        return Unary("Nack", pb.NackRequest(table=table, lease_id=lease_id), lambda r: r.requeued, retry=False)

    @declare(shards=lambda s: s._retire)
    def retire(self, groups: Iterable[str], table: str = "default") -> Plan[int]:
        """Consume groups this trainer trained without a lease (a framework's own queue held them),
        as `ack` consumes a lease's: their payloads go and their tombstones stay, so a push of them
        again is a duplicate, and a prompt whose group it is is trained. Ready groups, and groups
        leased with this client's token, retire; absent or retired ones are skipped; an incomplete
        one is FailedPreconditionError (none of its call retires). Any number, in calls of at most
        MAX_NAMES_PER_CALL (expbuf.client.schema.call_limits). Returns the groups retired.

        Sharded: each group on the shard that owns it; a shard that did not answer or refused
        raises ShardError, its `result` what each of the others retired, by shard (a retry of the
        whole call is safe)."""
        requests = [
            pb.RetireRequest(table=table, group_ids=part) for part in in_parts(list(groups), MAX_NAMES_PER_CALL)
        ]
        # a retired group stays retired: retried safely
        return Several([Unary("Retire", request, lambda r: r.retired, retry=True) for request in requests], sum)

    @declare(shards=lambda s: s._renew)
    def renew(self, lease_id: str, seconds: float, table: str = "default") -> Plan[float]:
        """Keep a lease for `seconds` more from now, for a step that outlasts the lease it took.
        Returns when the lease now ends (Unix time, the server's clock). Sharded: on the shards
        that leased it; the earliest end."""
        request = pb.RenewRequest(table=table, lease_id=lease_id, lease_seconds=seconds)
        return Unary("Renew", request, lambda r: r.lease_expires_unix, retry=True)

    @declare(shards=lambda s: s._set_trainer_version)
    def set_trainer_version(self, version: int, table: str = "default") -> Plan[int]:
        """Tell the table the trainer's current policy version (staleness is measured from it).
        Returns the version stored: it only moves forward, so a lower one keeps the table's.

        Sharded: on every shard, the lowest version a shard holds; a shard that does not answer
        is owed the version, sent the next time it answers (`pending`)."""
        request = pb.SetTrainerVersionRequest(table=table, version=_version(version))
        return Unary("SetTrainerVersion", request, lambda r: r.version, retry=True)

    @declare(shards=lambda s: s._reset_offpolicy)
    def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> Plan[dict[str, int]]:
        """Admin: reset the table's off-policy state for a job that starts over: the trainer
        version becomes `trainer_version` (None: unset), backwards too, and admission counts
        only the rollouts of grants still open. Returns both (trainer_version -1 = unset).
        Sharded: on every shard, each shard's answer by its name."""
        request = pb.ResetOffPolicyRequest(table=table)
        if trainer_version is not None:
            request.trainer_version, request.has_trainer_version = _version(trainer_version), True
        return Unary(
            "ResetOffPolicy",
            request,
            lambda r: {"trainer_version": r.trainer_version, "submitted": r.submitted},
            retry=True,
        )

    @declare(shards=lambda s: s._admit)
    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Plan[Grant]:
        """How many of `count` rollouts may start now under the table's staleness bound,
        waiting up to `wait` seconds for room (asking again while the server has as many admits
        waiting as it lets, as claim does). Finish the grant when the rollouts are done
        (`finish_grant`); a grant not finished within grant_seconds gives its room back.
        Sharded: on the table's admission shard (`admission_shard`)."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        request = pb.AdmitRequest(table=table, count=count, wait_seconds=wait, grant_seconds=grant_seconds)
        return Unary(
            "Admit",
            request,
            lambda r: Grant(r.granted, r.grant_id, r.expires_unix, table),
            retry=False,
            timeout=wait + self.timeout,
        )

    @declare(shards=lambda s: s._finish_grant)
    def finish_grant(self, grant: Grant, accepted: int | None = None) -> Plan[int]:
        """End a grant: `accepted` rollouts (None: all) stay counted; the others' room comes back.
        Sharded: on the shard that granted it."""
        request = pb.FinishGrantRequest(table=grant.table, grant_id=grant.grant_id, accepted=accepted)
        return Unary("FinishGrant", request, lambda r: r.returned, retry=False)

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


class Orders:
    """The orders a client's server samples in, for a check of a sample's order before its stream
    opens (both clients'): a built-in order is every server's; another name is looked up among
    the server's (ServerInfo's `orders`), asked once, and again for a name not among them (a
    server restarted since may have registered it)."""

    def __init__(self) -> None:
        self.known: frozenset[str] = frozenset(wire.ORDER)

    def check(self, order: str) -> Unary[None] | None:
        """The call that refuses `order`, ValueError naming the server's orders, when the server
        has no such order; None where there is nothing to ask. A server before this release names
        none: it checks the order itself, as the stream opens."""
        if order in self.known:
            return None

        def read(reply: pb.ServerInfoReply) -> None:
            if not reply.orders:
                return
            self.known = frozenset(reply.orders)
            if order not in self.known:
                raise ValueError(
                    f"sample: order is {order!r}; this server samples in the orders {', '.join(reply.orders)}"
                )

        return Unary("ServerInfo", pb.ServerInfoRequest(), read, retry=True)


# ---- the Sample stream ----------------------------------------------------------------------


def confirmation(received: int, *, stop: bool = False) -> pb.SampleRequest:
    """Tells the server that `received` batches arrived, which frees room in the window for
    more (or, with `stop`, asks for nothing more: batches already on their way return to
    the buffer)."""
    return pb.SampleRequest(received=received, stop=stop)


def batch(reply: SampleReplyParts, table: str, leases: Leases | None, kind: type[B], *, columnar: bool = False) -> B:
    """A sampled batch, decoded (the checks a reader relies on), that acknowledges, gives
    back and renews through `leases` (the client's). The client confirms a batch only once
    this returns: one it cannot decode raises DataLossError naming it, and goes back.
    `columnar`: the request named fields, so the reply must carry columns, not a payload."""
    rest = reply.rest
    try:
        if columnar and reply.payload:
            raise ValueError(
                "the request named fields, and the server sent a TRXP payload: it predates columnar batches "
                "(a server of this release or later sends them)"
            )
        made = kind(
            payload=trxp.attach_advantages(reply.payload, rest.advantages, rest.response_lengths),
            uids=list(rest.uids),
            group_ids=list(rest.group_ids),
            lease_id=rest.lease_id,
            lease_expires=rest.lease_expires_unix,
            partial=rest.partial,
            table=table,
            times_sampled=list(rest.times_sampled),
            _leases=leases,
            confirm_seconds=rest.confirm_seconds,
            columns=(
                decode_columns(rest.columns, len(rest.uids), reply.values, rest.missing_fields)
                if rest.columns or rest.missing_fields
                else {}
            ),
        )
        if not made.columnar:
            _ = made.experiences  # decoded now, before it is confirmed
    except (trxp.TrxpError, ValueError, OverflowError) as exc:
        groups = list(dict.fromkeys(rest.group_ids))
        raise DataLossError(
            grpc.StatusCode.DATA_LOSS,
            f"a batch of table '{table}' ({len(rest.uids)} experiences, groups {', '.join(groups[:4])}"
            f"{', ...' if len(groups) > 4 else ''}) could not be decoded, so it was not confirmed and goes back "
            f"to the buffer: {type(exc).__name__}: {exc}",
        ) from exc
    return made


def late(table: str, seconds: float, since: float) -> DeadlineExceededError | None:
    """The error of a batch asked for too late for a server that waits `seconds` (a reply's
    confirm_seconds; 0: unknown) for its confirmation, counted from the confirmation before it, sent
    at `since` (see `handed`); None in time."""
    waited = time.monotonic() - since
    if not seconds or waited <= seconds - min(seconds / 10, CONFIRM_MARGIN):
        return None
    return DeadlineExceededError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"a batch of table '{table}' was asked for {waited:.1f}s after the batch before it (or the stream's "
        f"start), too late for the server, which waits {seconds:g}s for its confirmation (max_confirm_seconds, "
        "EXPBUF_MAX_CONFIRM_SECONDS): it was not handed over and goes back to the buffer with the batches after "
        "it. Open a new sample() to go on; a step this long needs a larger max_confirm_seconds",
    )


def ended_late(code: grpc.StatusCode, table: str, seconds: float, since: float) -> DeadlineExceededError | None:
    """What a Sample stream that ended with `code` was, when the server cancelled it because its
    client came late (`late`: the server ends a stream whose reply its client has not taken for
    max_confirm_seconds, a step that long with a batch too large to wait in the channel's
    buffers); None otherwise."""
    return late(table, seconds, since) if code == grpc.StatusCode.CANCELLED else None


def handed(made: B, lease_seconds: float, since: float) -> B:
    """The batch as the client hands it to its caller, confirming it: a lease's clock starts now.

    The server gives a batch back (and ends the stream) when its confirmation has not come
    `confirm_seconds` (the reply's) after the client's confirmation before it, sent at `since`
    (time.monotonic(); the stream's first request, for the first batch). A batch asked for
    past that, less a tenth (at most CONFIRM_MARGIN) for the confirmation's way, may be in the
    buffer again already: it is not handed over, so no batch is trained that another trainer
    may get, and DeadlineExceededError says why."""
    error = late(made.table, made.confirm_seconds, since)
    if error is not None:
        raise error
    if made.lease_id:
        made.lease_expires = time.time() + lease_seconds
    return made
