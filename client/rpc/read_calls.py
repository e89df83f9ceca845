"""The calls that read named experiences (ReadFields: some fields, shares of their tokens, a
rank's part of a leased step, or the experiences whole; Get; ListExperiences), described as
`Unary` calls (calls.py) for the blocking and the asyncio client."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable
from typing import Any, TypedDict

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from .. import trxp
from ..columns import decode_columns, join_columns
from ..errors import DataLossError
from ..results import ExperiencePage, FieldBatch, GetResult, ListedExperience
from ..schema.balance import MAX_RANKS, ModelShape
from ..schema.call_limits import MAX_READ_UIDS, in_parts
from ..schema.experience import Experience
from ..trxp.stored.columns import Shares, unknown_field
from .calls import Several, Unary
from .sample_reply import SampleReplyParts


def read_fields(
    uids: Iterable[str], fields: Iterable[str], table: str, share: int | Iterable[int], of: int, max_reply_bytes: int
) -> Several[FieldBatch, FieldBatch]:
    """ReadFields of `uids`, MAX_READ_UIDS a call, `share` (one share or several, in order) of `of`
    of their tokens (of=0: whole), joined in order; a ValueError names a share that is not one, or a
    uid named twice (the server refuses it in one call, and calls apart would read it twice). A
    prompt that the runs of one call share comes once a call (prefix_tokens)."""
    uids, fields, take = list(uids), list(fields), share if isinstance(share, int) else tuple(share)
    if len(set(uids)) < len(uids):
        twice = next(uid for uid, count in collections.Counter(uids).items() if count > 1)
        raise ValueError(f"read_fields: uid {twice!r} is named more than once")
    calls = [
        _fields_call(
            pb.ReadFieldsRequest(table=table, uids=part, fields=fields, max_reply_bytes=max_reply_bytes), take, of
        )
        for part in in_parts(uids, MAX_READ_UIDS)
    ]
    return Several(calls, _joined_fields)


def _joined_fields(parts: list[FieldBatch]) -> FieldBatch:
    """FieldBatches of uids read in parts, as one read of them all."""
    if len(parts) == 1:
        return parts[0]
    starts = itertools.accumulate((len(part.uids) for part in parts), initial=0)
    columns = join_columns(
        [(range(start, start + len(part.uids)), part.columns) for start, part in zip(starts, parts, strict=False)]
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


def read_part(
    lease_id: str,
    rank: int,
    ranks: int,
    fields: Iterable[str],
    table: str,
    options: ReadPartOptions,
    max_reply_bytes: int,
) -> Unary[FieldBatch]:
    """ReadFields of rank `rank`'s part of a leased batch spread over `ranks` ranks as `options`
    split it (schema/balance.py; a balance the server registered too, which it checks), and
    their `share` of `of` as read_fields'; ValueError before the call for what is not a part or
    a share."""
    request = part_request(lease_id, rank, ranks, table, split_of(options, "read_part"), max_reply_bytes)
    request.fields.extend(fields)
    return _fields_call(request, options.get("share", ()), options.get("of", 0))


def get_part(
    lease_id: str, rank: int, ranks: int, table: str, options: PartOptions, max_reply_bytes: int
) -> Unary[GetResult]:
    """Rank `rank`'s part of a leased batch (split by `options`, as read_part's keywords) as whole
    experiences in the lease's order, in parts when large."""
    request = part_request(lease_id, rank, ranks, table, split_of(options), max_reply_bytes)

    def read(reply: SampleReplyParts) -> GetResult:
        return GetResult(trxp.decode_reply(reply.payload), list(reply.rest.missing_uids))

    return Unary("ReadFields", request, read, retry=True, parts=True)


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


def get(uids: Iterable[str], table: str, max_reply_bytes: int) -> Several[list[Experience], GetResult]:
    """The experiences among uids, in request order: read over ReadFields without fields,
    MAX_READ_UIDS a call, whole and in parts when large, so that no experience is too large to read
    back; over Get from a server without ReadFields."""
    asked = list(uids)

    def joined(parts: list[list[Experience]]) -> GetResult:
        found = {exp.eid.uid: exp for part in parts for exp in part}
        return GetResult([found[uid] for uid in asked if uid in found], [uid for uid in asked if uid not in found])

    def experiences(reply: Any) -> list[Experience]:  # a ReadFields' reply put together, or a Get's
        return trxp.decode_reply(reply.payload)

    calls = [
        Unary(
            "ReadFields",
            pb.ReadFieldsRequest(table=table, uids=part, max_reply_bytes=max_reply_bytes),
            experiences,
            retry=True,
            parts=True,
            fallback=Unary("Get", pb.GetRequest(table=table, uids=part), experiences, retry=True),
        )
        for part in in_parts(list(dict.fromkeys(asked)), MAX_READ_UIDS)  # ReadFields names each uid once
    ]
    return Several(calls, joined)


class ListFilters(TypedDict, total=False):
    """The keywords of `list_experiences()` after the table: which experiences, and the page."""

    states: Iterable[str]
    min_model_version: int | None
    max_model_version: int | None
    after: int
    limit: int


def list_experiences(
    table: str,
    *,
    states: Iterable[str] = (),
    min_model_version: int | None = None,
    max_model_version: int | None = None,
    after: int = 0,
    limit: int = 1000,
) -> Unary[ExperiencePage]:
    """Of the table's live experiences in insertion order, those of `states` (all when empty) and of
    model versions in the range given, a page of up to `limit` after position `after`."""

    def optional(msg: Any, name: str) -> Any:
        return getattr(msg, name) if msg.HasField(name) else None

    def read(reply: pb.ListExperiencesReply) -> ExperiencePage:
        listed = [
            ListedExperience(
                e.uid, e.group_id, e.state, optional(e, "model_version"), optional(e, "reward"), e.times_sampled
            )
            for e in reply.experiences
        ]
        return ExperiencePage(listed, reply.next, reply.done)

    request = pb.ListExperiencesRequest(
        table=table,
        states=list(states),
        min_model_version=min_model_version,
        max_model_version=max_model_version,
        after=after,
        limit=limit,
    )
    return Unary("ListExperiences", request, read, retry=True)


def get_partials(
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
