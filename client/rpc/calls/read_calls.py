"""The reads of named experiences as the clients make them (ExperienceReads, declared once:
rpc/declare.py): some fields, shares of their tokens, a rank's part of a leased step, or the
experiences whole, over ReadFields; Get from an older server; the rollouts held in pieces."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable
from typing import Any, TypedDict, Unpack

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from ... import trxp
from ...columns import decode_columns, join_columns
from ...errors import DataLossError
from ...results import FieldBatch, GetResult
from ...schema.balance import MAX_RANKS, ModelShape
from ...schema.call_limits import MAX_READ_UIDS, in_parts
from ...schema.experience import Experience
from ...trxp.stored.columns import Shares, unknown_field
from ..declare import ClientSettings, Plan, Several, Steps, Unary, declare
from ..sample_reply import SampleReplyParts


def _joined_fields(parts: list[FieldBatch], fields: list[str]) -> FieldBatch:
    """FieldBatches of uids read in parts, as one read of them all (of `fields`, in that order)."""
    if len(parts) == 1:
        return parts[0]
    starts = itertools.accumulate((len(part.uids) for part in parts), initial=0)
    columns = join_columns(
        [(range(start, start + len(part.uids)), part.columns) for start, part in zip(starts, parts, strict=False)],
        fields,
    )
    return FieldBatch(
        [uid for part in parts for uid in part.uids],
        [group for part in parts for group in part.group_ids],
        [uid for part in parts for uid in part.missing_uids],
        columns,
        parts[0].table,
    )


class PartOptions(TypedDict, total=False):
    """How a leased step is split over its ranks (get_part's keywords): balance ("tokens"), model
    (for "flops"), equal (as many groups a rank)."""

    balance: str
    model: ModelShape | None
    equal: bool


class ReadPartOptions(PartOptions, total=False):
    """read_part's keywords: the split's, and `share` of `of` of each run's tokens (read_fields')."""

    share: int | Iterable[int]
    of: int


def split_of(options: PartOptions, call: str = "get_part") -> tuple[str, ModelShape | None, bool]:
    """The balance, model and equal of a call's keywords; TypeError for one it does not take."""
    known = ReadPartOptions.__annotations__ if call == "read_part" else PartOptions.__annotations__
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {', '.join(unknown)}")
    return options.get("balance", "tokens"), options.get("model"), options.get("equal", False)


def part_request(
    lease_id: str,
    rank: int,
    ranks: int,
    table: str,
    split: tuple[str, ModelShape | None, bool],
    max_reply_bytes: int,
) -> pb.ReadFieldsRequest:
    """A ReadFields request of rank `rank`'s part of a leased batch (as `split` = balance, model,
    equal splits it), checked before the call."""
    balance, model, equal = split
    check_part(lease_id, rank, ranks, balance, model)
    request = pb.ReadFieldsRequest(
        table=table, lease_id=lease_id, rank=rank, ranks=ranks, balance=balance, max_reply_bytes=max_reply_bytes,
        equal=equal,
    )  # fmt: skip
    if model is not None:
        request.model.CopyFrom(pb.ModelShape(params=model.params, layers=model.layers, hidden=model.hidden))
    return request


def check_part(lease_id: str, rank: int, ranks: int, balance: str, model: ModelShape | None) -> None:
    """A ValueError, before any call, for what is not a rank's part of a leased step."""
    if not lease_id:
        raise ValueError("lease_id: the part of a batch is named by its lease (batch.lease_id, a leased sample's)")
    if not 1 <= ranks <= MAX_RANKS or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks}: ranks is 1 to {MAX_RANKS}, a rank 0 to ranks - 1")
    if balance == "flops" and model is None:
        raise ValueError("balance 'flops' needs the model's shape: model=ModelShape(params, layers, hidden)")


def _fields_call(request: pb.ReadFieldsRequest, share: int | Iterable[int], of: int) -> Unary[FieldBatch]:
    """A ReadFields `request` with `share` of `of` of each experience's tokens (of=0: whole)."""
    if not request.fields:
        raise ValueError("fields: name the fields to read (get() and get_part() read experiences whole)")
    unknown = unknown_field(request.fields)
    if unknown is not None:
        raise ValueError(f"fields: {unknown}")
    take = (share,) if isinstance(share, int) else tuple(share)
    if of or take:
        Shares(of, take)  # checked here, before the call
    request.shares = of
    request.take.extend(take)
    table = request.table
    return Unary("ReadFields", request, lambda reply: field_batch(reply, table), retry=True, parts=True)


def field_batch(reply: SampleReplyParts, table: str) -> FieldBatch:
    """A ReadFields reply as a FieldBatch; DataLossError where its columns do not fit their framing."""
    rest = reply.rest
    try:
        columns = decode_columns(rest.columns, len(rest.uids), reply.values, rest.missing_fields)
    except (ValueError, OverflowError) as exc:
        raise DataLossError(
            grpc.StatusCode.DATA_LOSS, f"the fields read from table '{table}' could not be decoded: {exc}"
        ) from exc
    return FieldBatch(list(rest.uids), list(rest.group_ids), list(rest.missing_uids), columns, table)


class ExperienceReads(ClientSettings):
    """The reads of named experiences, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: s._get)
    def get(self, uids: Iterable[str], table: str = "default") -> Plan[GetResult]:
        """The stored experiences among uids, in request order; `.missing_uids` lists the others.
        Read in parts no larger than the client's max_message_bytes, however large they are.

        Sharded: each asked of the shard that owns its group; when a uid's owner is down, raises
        ShardError, its `result` holding what was found."""
        # Over ReadFields without fields, MAX_READ_UIDS a call, each uid once, whole and in parts
        # when large, so that no experience is too large to read back; over Get from a server
        # without ReadFields.
        asked = list(uids)

        def joined(parts: list[list[Experience]]) -> GetResult:
            found = {exp.eid.uid: exp for part in parts for exp in part}
            return GetResult([found[uid] for uid in asked if uid in found], [uid for uid in asked if uid not in found])

        def experiences(reply: Any) -> list[Experience]:  # a ReadFields' reply put together, or a Get's
            return trxp.decode_reply(reply.payload)

        calls = [
            Unary(
                "ReadFields",
                pb.ReadFieldsRequest(table=table, uids=part, max_reply_bytes=self.max_message_bytes),
                experiences,
                retry=True,
                parts=True,
                fallback=Unary("Get", pb.GetRequest(table=table, uids=part), experiences, retry=True),
            )
            for part in in_parts(list(dict.fromkeys(asked)), MAX_READ_UIDS)
        ]
        return Several(calls, joined)

    @declare(shards=lambda s: s._read_fields)
    def read_fields(
        self,
        uids: Iterable[str],
        fields: Iterable[str],
        table: str = "default",
        *,
        share: int | Iterable[int] = (),
        of: int = 0,
    ) -> Plan[FieldBatch]:
        """Some fields of the experiences `uids` as columns (`.columns`, `.tensordict()`), as they
        stand (leased ones too), in request order; `.missing_uids` lists those not served. The
        ranks of a trainer each read their part of a batch one process sampled (and acks).

        With `of`, each experience's tokens are cut into `of` equal runs, and only run `share`
        (or the runs listed, in that order) of each tensor laid along them comes: a context-parallel
        rank r of C reads `share=r, of=C`, or, balanced as Megatron-LM splits a causal sequence,
        `share=(r, 2 * C - 1 - r), of=2 * C`. A tensor of the experience's token count along its
        first dimension (tokens, routing ids) is cut at those positions, a response field
        (logprobs, action_mask, advantages, ...) at those after the prompt, any other comes whole.
        A large experience's chunks outside the share are not read from disk.

        Sharded: each uid's fields read from the shard that owns its group, in request order; when
        a uid's owner is down, raises ShardError, its `result` holding what was read."""
        # MAX_READ_UIDS a call, joined in order; a ValueError names a share that is not one, or a
        # uid named twice (the server refuses it in one call, and calls apart would read it twice).
        # A prompt that the runs of one call share comes once a call (prefix_tokens).
        uids, fields, take = list(uids), list(fields), share if isinstance(share, int) else tuple(share)
        if len(set(uids)) < len(uids):
            twice = next(uid for uid, count in collections.Counter(uids).items() if count > 1)
            raise ValueError(f"read_fields: uid {twice!r} is named more than once")
        calls = [
            _fields_call(
                pb.ReadFieldsRequest(table=table, uids=part, fields=fields, max_reply_bytes=self.max_message_bytes),
                take,
                of,
            )
            for part in in_parts(uids, MAX_READ_UIDS)
        ]
        return Several(calls, lambda parts: _joined_fields(parts, fields))

    @declare(shards=lambda s: s._read_part)
    def read_part(
        self,
        lease_id: str,
        rank: int,
        ranks: int,
        fields: Iterable[str],
        table: str = "default",
        **options: Unpack[ReadPartOptions],
    ) -> Plan[FieldBatch]:
        """Rank `rank`'s part of the batch leased as `lease_id` (a leased sample's `batch.lease_id`,
        which the process that sampled it hands to every rank), for a step spread over `ranks`
        data-parallel ranks: its groups, whole, as columns of `fields` (a FieldBatch; `share` and
        `of` as read_fields'). The server splits the lease's groups so that the ranks' loads are as
        equal as the groups allow (Karmarkar-Karp over each group's tokens; its runs with
        balance="count"; its FLOPs with balance="flops" and `model`, a ModelShape(params, layers,
        hidden)), the same split for every rank that asks: a rank that dies and comes
        back reads its part again while the lease holds. With `equal`, every rank gets as many
        groups as the others, or one fewer. The process that sampled the batch acks it once every
        rank has trained its part.

        Sharded, for a batch leased from several shards: the groups of every shard are split over
        the ranks together (the same split in every rank's process), and each rank's read from
        the shards that hold them; a shard of the lease that does not answer raises ShardError."""
        # A balance the server registered too, which it checks; ValueError before the call for
        # what is not a part or a share.
        split = split_of(options, "read_part")
        request = part_request(lease_id, rank, ranks, table, split, self.max_message_bytes)
        request.fields.extend(fields)
        return _fields_call(request, options.get("share", ()), options.get("of", 0))

    @declare(shards=lambda s: s._get_part)
    def get_part(
        self, lease_id: str, rank: int, ranks: int, table: str = "default", **split: Unpack[PartOptions]
    ) -> Plan[GetResult]:
        """Rank `rank`'s part of the batch leased as `lease_id`, split as read_part splits it (its
        balance, model and equal), as whole experiences (what a framework's adapter converts), in
        the lease's order; read in parts no larger than the client's max_message_bytes.

        Sharded, for a batch leased from several shards: each experience read from the shard that
        holds it."""
        request = part_request(lease_id, rank, ranks, table, split_of(split), self.max_message_bytes)

        def read(reply: SampleReplyParts) -> GetResult:
            return GetResult(trxp.decode_reply(reply.payload), list(reply.rest.missing_uids))

        return Unary("ReadFields", request, read, retry=True, parts=True)

    @declare(shards=lambda s: s._get_partials)
    def get_partials(self, task_ids: Iterable[str], table: str = "default") -> Steps[list[Experience]]:
        """The rollouts of these tasks (batch/task) held in pieces, each put together as it stands
        and marked partial (push scope): what a rollout worker continues, with `continuation`. A
        prompt's claimant gets those of the attempt before it under its own task.

        Sharded: from every shard (a rollout's pieces are on the shard that owns its group, which a
        table grouping by run or step spreads a task over)."""
        found: list[Experience] = []
        for tasks in in_parts(list(task_ids), MAX_READ_UIDS):  # the server reads at most as many a call
            more, rest = yield _partials(tasks, (), table, self.max_message_bytes)
            found += more
            while rest:  # those one reply did not hold (each reply holds one at least)
                more, left = yield _partials((), rest[:MAX_READ_UIDS], table, self.max_message_bytes)
                found += more
                rest = left + rest[MAX_READ_UIDS:]
        return found


def _partials(
    task_ids: Iterable[str], uids: Iterable[str], table: str, max_reply_bytes: int
) -> Unary[tuple[list[Experience], list[str]]]:
    """The rollouts of these tasks and uids held in pieces, each as it stands (marked partial), as
    many as one reply holds (in parts, a rollout larger than a message alone), and the uids of the
    others, to ask for again. An older server, without ReadPartials, answers the unary GetPartials."""
    request = pb.GetPartialsRequest(
        table=table, task_ids=list(task_ids), uids=list(uids), max_reply_bytes=max_reply_bytes
    )

    def read(reply: SampleReplyParts) -> tuple[list[Experience], list[str]]:
        return trxp.decode(reply.payload), list(reply.rest.missing_uids)

    unary = Unary("GetPartials", request, lambda r: (trxp.decode(r.payload), list(r.missing_uids)), retry=True)
    return Unary("ReadPartials", request, read, retry=True, parts=True, fallback=unary)
