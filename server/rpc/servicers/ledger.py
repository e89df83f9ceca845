"""The prompt ledger's calls of the ExperienceBuffer servicer (CreateDataset, ListDatasets,
Claim, RenewClaims, ReleaseClaims, ReportPrompts, ListPrompts), and their records on the wire.

The rules are the storage engine's (store/ledger/rules.py); here requests become its calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import grpc

from expbuf.client.schema.call_limits import MAX_REWARDS
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store import (
    MAX_ATTEMPTS,
    MAX_EPOCHS,
    MAX_OWNER_BYTES,
    MAX_PAGE,
    MAX_SIZE,
    PROMPT_STATES,
    Claimed,
    DatasetRecord,
    KeptStats,
    PromptRecord,
    check_claim,
    check_refs,
    prompt_eid,
    shown_owner,
)
from ...store.schema.errors import InvalidRequest, TooLarge, check_names, clip
from ..call_context import MIN_REPLY_BYTES, ended, refusals, remaining
from .base import ServicerBase

# A ClaimReply's or ListPromptsReply's fields beside its prompts: done, and where a page ended.
_REPLY_FIELDS = 32


def dataset_of(config: pb.DatasetConfig) -> DatasetRecord:
    """A CreateDataset request's settings as a record (ledger.check names those out of range)."""
    return DatasetRecord(
        name=config.name,
        size=config.size,
        epochs=config.epochs or 1,
        seed=config.seed if config.HasField("seed") else None,
        max_in_flight=config.max_in_flight,
        on_drop=config.on_drop or "done",
        max_attempts=config.max_attempts or 5,
        shards=list(config.shards),
        shard=config.shard,
        pass_threshold=config.pass_threshold,
        order=config.order or "permutation",
        order_options=dict(config.order_options),
        zero_variance=config.zero_variance or "keep",
        skip_epochs=config.skip_epochs or 1,
    )


def info_of(ds: DatasetRecord) -> pb.DatasetInfo:
    """A dataset, its cursor, its counts by epoch started and over every epoch, as DatasetInfo."""
    config = pb.DatasetConfig(
        name=ds.name,
        size=ds.size,
        epochs=ds.epochs,
        max_in_flight=ds.max_in_flight,
        on_drop=ds.on_drop,
        max_attempts=ds.max_attempts,
        shards=ds.shards,
        shard=ds.shard,
        pass_threshold=ds.pass_threshold,
        order=ds.order,
        order_options=ds.order_options,
        zero_variance=ds.zero_variance,
        skip_epochs=ds.skip_epochs,
    )
    if ds.seed is not None:
        config.seed = ds.seed
    counts = [pb.EpochCounts(**ds.states(epoch)) for epoch in range(len(ds.counts))]
    return pb.DatasetInfo(
        config=config,
        created_unix=ds.created,
        cursor_epoch=ds.cursor_epoch,
        cursor_position=ds.cursor_position,
        counts=counts,
        reissued=ds.reissued,
        attempts_dropped=ds.attempts_dropped,
        done=ds.done,
        owned=ds.owned_total,
        totals=pb.EpochCounts(**ds.overall()),
        skipped=ds.skipped,
    )


def create_reply_bytes(ds: DatasetRecord) -> int:
    """The most bytes CreateDataset's reply takes for a new dataset of these settings: as a new
    one, its cursor at the start and one epoch started, with every count at its largest."""
    owned = min(ds.size * ds.epochs, 2**64 - 1)  # settings out of range are refused by name after this
    new = replace(ds, created=1.0, owned_total=owned, owned=[ds.size], counts=[{}], totals={})
    return pb.CreateDatasetReply(dataset=info_of(new), created=True).ByteSize()


def prompt_of(dataset: str, claimed: Claimed) -> pb.Prompt:
    batch, task = prompt_eid(dataset, claimed.epoch, claimed.index, claimed.attempt)
    return pb.Prompt(
        dataset=dataset,
        epoch=claimed.epoch,
        index=claimed.index,
        attempt=claimed.attempt,
        batch=batch,
        task=task,
        expires_unix=claimed.expires,
        state="claimed",
    )


def prompt_bytes(dataset: str, owner: str, stats: bool = False) -> int:
    """The most bytes one prompt of `dataset` claimed by `owner` adds to a reply: every number
    at its largest, the longest state, its statistics where listed, and the prompt's tag and length."""
    epoch, index, attempt = MAX_EPOCHS - 1, MAX_SIZE - 1, MAX_ATTEMPTS - 1
    batch, task = prompt_eid(dataset, epoch, index, attempt)
    longest = max(PROMPT_STATES, key=len)
    size = pb.Prompt(
        dataset=dataset, epoch=epoch, index=index, attempt=attempt, batch=batch, task=task, expires_unix=1.0,
        state=longest, owner=owner, stats=_LARGEST_STATS if stats else None,
    ).ByteSize()  # fmt: skip
    return 1 + (size.bit_length() + 6) // 7 + size


_LARGEST_STATS = pb.PromptStats(
    attempts=2**32 - 1, generated=2**32 - 1, runs=2**64 - 1, passes=2**64 - 1, last_runs=2**32 - 1, last_mean=1.0,
    last_var=1.0, trained=2**32 - 1, last_epoch=-1, last_step=-1,
)  # fmt: skip


def most_prompts(dataset: str, owner: str, max_message_bytes: int, stats: bool = False) -> int:
    """The most prompts of `dataset` claimed by `owner` that one reply can carry."""
    return max(0, max_message_bytes - _REPLY_FIELDS) // prompt_bytes(dataset, owner, stats)


def _refs(prompts: Iterable[pb.PromptRef]) -> list[tuple[int, int, int]]:
    return [(p.epoch, p.index, p.attempt) for p in prompts]


class LedgerServicer(ServicerBase):
    """The ledger's calls, mixed into the servicer (rpc/service.py), which provides the store,
    the caller's token fingerprint, the bound on waits and the largest message."""

    max_wait_seconds: float

    @refusals
    def CreateDataset(self, request: pb.CreateDatasetRequest, context: grpc.ServicerContext) -> pb.CreateDatasetReply:
        """A dataset created, refused before it is stored when its reply could not be sent: the
        reply repeats the settings, up to 1,024 shard names of them, which may outgrow a small
        max_message_bytes the request fitted in."""
        wanted = dataset_of(request.config)
        most = create_reply_bytes(wanted)
        if most > self.max_message_bytes:
            raise InvalidRequest(
                f"the reply would take up to {most} bytes, over the server's max_message_bytes ="
                f" {self.max_message_bytes}: it repeats the settings, the names of {len(wanted.shards)} shards among"
                " them, with the dataset's counts; nothing is created"
            )
        record, created = self.store.create_dataset(
            request.table or "default",
            wanted,
            exist_ok=request.exist_ok,
            stop=ended(context),  # a shard's part may take a while to count
        )
        return pb.CreateDatasetReply(dataset=info_of(record), created=created)

    @refusals
    def ListDatasets(self, request: pb.ListDatasetsRequest, context: grpc.ServicerContext) -> pb.ListDatasetsReply:
        records = self.store.datasets(request.table or "default", request.name)
        return pb.ListDatasetsReply(datasets=[info_of(record) for record in records])

    @refusals
    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimReply:
        """Prompts claimed, refused before it claims any whose reply could not be sent, or could
        not be received by a client that says what it receives (max_reply_bytes): the claims
        would stay, held by a caller that never learned which prompts they were."""
        check_claim(request.count, request.owner, request.wait_seconds, request.claim_id)
        if 0 < request.max_reply_bytes < MIN_REPLY_BYTES:
            raise InvalidRequest(
                f"max_reply_bytes = {request.max_reply_bytes}; it must be 0 (the server's max_message_bytes"
                f" alone) or at least {MIN_REPLY_BYTES}"
            )
        dataset, owner_bytes = clip(request.dataset), len(request.owner.encode())
        most = most_prompts(request.dataset, request.owner, self.max_message_bytes)
        if request.count > most:
            raise InvalidRequest(
                f"count is {request.count}; a reply holds at most {most} prompts of dataset '{dataset}'"
                f" claimed by an owner of {owner_bytes} bytes within the server's"
                f" max_message_bytes = {self.max_message_bytes}"
            )
        receives = request.max_reply_bytes
        fits = most_prompts(request.dataset, request.owner, receives) if receives else most
        if request.count > fits:
            raise TooLarge(
                f"count is {request.count}; at most {fits} prompts fit in a reply this client receives"
                f" (its max_message_bytes = {receives}), of dataset '{dataset}' claimed by an owner of"
                f" {owner_bytes} bytes: nothing is claimed; claim {fits} at a time, or raise the client's"
                " max_message_bytes"
            )
        asked = min(request.wait_seconds, self.max_wait_seconds)  # a waiting claim holds a worker thread
        claimed, done = self.store.claim(
            request.table or "default",
            request.dataset,
            request.count,
            seconds=request.lease_seconds,
            owner=request.owner,
            holder=self._owner(context),
            wait=remaining(context, asked),
            stop=ended(context),
            claim_id=request.claim_id,
        )
        prompts = [prompt_of(request.dataset, c) for c in claimed]
        for prompt in prompts:
            prompt.owner = request.owner
        return pb.ClaimReply(prompts=prompts, done=done)

    @refusals
    def RenewClaims(self, request: pb.RenewClaimsRequest, context: grpc.ServicerContext) -> pb.RenewClaimsReply:
        check_refs(request.prompts, "RenewClaims")  # before the prompts are read
        expires, ended = self.store.renew_claims(
            request.table or "default", request.dataset, _refs(request.prompts), request.lease_seconds,
            holder=self._owner(context),
        )  # fmt: skip
        refs = [pb.PromptRef(epoch=e, index=i, attempt=a) for e, i, a in ended]
        return pb.RenewClaimsReply(expires_unix=expires, ended=refs)

    @refusals
    def ReleaseClaims(self, request: pb.ReleaseClaimsRequest, context: grpc.ServicerContext) -> pb.ReleaseClaimsReply:
        check_refs(request.prompts, "ReleaseClaims")  # before the prompts are read
        released = self.store.release_claims(
            request.table or "default", request.dataset, _refs(request.prompts), holder=self._owner(context)
        )
        return pb.ReleaseClaimsReply(released=released)

    @refusals
    def ReportPrompts(self, request: pb.ReportPromptsRequest, context: grpc.ServicerContext) -> pb.ReportPromptsReply:
        check_refs(request.outcomes, "ReportPrompts")  # before the outcomes are read
        for outcome in request.outcomes:
            check_names(outcome.rewards, "a prompt's rewards", "ReportPrompts", MAX_REWARDS)
        outcomes = [(o.prompt.epoch, o.prompt.index, o.prompt.attempt, list(o.rewards)) for o in request.outcomes]
        reported = self.store.report_prompts(
            request.table or "default", request.dataset, outcomes, holder=self._owner(context)
        )
        return pb.ReportPromptsReply(reported=reported)

    @refusals
    def ListPrompts(self, request: pb.ListPromptsRequest, context: grpc.ServicerContext) -> pb.ListPromptsReply:
        check_names(request.states, "states", "ListPrompts", len(PROMPT_STATES))  # before they are read
        unknown = [state for state in request.states if state not in PROMPT_STATES]
        if unknown:
            raise InvalidRequest(f"states: {unknown[:4]!r}; expected some of {', '.join(PROMPT_STATES)}")
        limit = request.limit or 1000
        fits = max(1, most_prompts(request.dataset, "o" * MAX_OWNER_BYTES, self.max_message_bytes, stats=True))
        page = self.store.list_prompts(
            request.table or "default",
            request.dataset,
            states=list(request.states),
            after=(request.after_epoch, request.after_index) if request.has_after else None,
            limit=limit if limit > MAX_PAGE else min(limit, fits),  # out of range: refused by name; else what fits
        )
        after = page.after or (0, 0)
        return pb.ListPromptsReply(
            prompts=[
                _listed(request.dataset, epoch, index, rec, page.stats[index]) for epoch, index, rec in page.prompts
            ],
            after_epoch=after[0],
            after_index=after[1],
            done=page.done,
        )


def _listed(dataset: str, epoch: int, index: int, rec: PromptRecord, stats: KeptStats) -> pb.Prompt:
    batch, task = prompt_eid(dataset, epoch, index, rec.attempt)
    return pb.Prompt(
        dataset=dataset, epoch=epoch, index=index, attempt=rec.attempt, batch=batch, task=task,
        expires_unix=rec.expires, state=rec.state, owner=shown_owner(rec.owner),
        stats=pb.PromptStats(
            attempts=stats.attempts, generated=stats.generated, runs=stats.runs, passes=stats.passes,
            last_runs=stats.last_runs, last_mean=stats.last_mean, last_var=stats.last_var, trained=stats.trained,
            last_epoch=stats.last_epoch, last_step=stats.last_step,
        ),
    )  # fmt: skip
