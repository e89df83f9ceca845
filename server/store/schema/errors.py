"""Every refusal the server makes, each class carrying the gRPC status it maps to and its
reason (client/schema/reasons.py: sent to the client with the refusal, and counted on
`expbuf_refused_total`), and `clip`, which keeps untrusted input out of messages and
logs at a bounded length.

The service maps a refusal to its status and reason by its class alone (rpc/service.py); a new
refusal is one class here. `status` is the name of a `grpc.StatusCode` member, so the storage
engine, which raises most of these and holds this module, does not import grpc (a contract in
pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import ClassVar

from expbuf.client.schema.reasons import Reason

CLIP = 100


def clip(value: object, limit: int = CLIP) -> str:
    """`value` as text of at most about `limit` characters, saying how long it was."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def check_names(names: Sized, what: str, call: str, most: int) -> None:
    """Refuse a call naming more than `most` of `what` before it looks one up: the writer, or a
    reader's thread, is held while it does (client/schema/call_limits.py)."""
    if len(names) > most:
        raise InvalidRequest(
            f"{what} names {len(names)}; a {call} names at most {most} (the clients split larger ones into calls of"
            " this many)"
        )


# What a read of stored bytes that a damaged page may have changed catches as damage: LMDB, a record's
# or row's decoder, the TRXP parser can raise almost anything then (lmdb.Error, ValueError,
# struct.error, KeyError, ...), so every exception is.
DAMAGE = Exception


class StoreError(Exception):
    """A refused request: `status` names the gRPC status code it maps to, `reason` its label on
    the refusals metric. Raised as it is, a fault of the server rather than of the request."""

    status: ClassVar[str] = "INTERNAL"
    reason: ClassVar[Reason] = Reason.INTERNAL


class InvalidRequest(StoreError):
    """A request whose fields the server cannot take; the message names the field."""

    status = "INVALID_ARGUMENT"
    reason = Reason.INVALID_REQUEST


class InvalidPayload(InvalidRequest):
    """A push whose payload the TRXP codec refused; the message names the item and field."""

    reason = Reason.INVALID_PAYLOAD


class ConfigError(InvalidRequest, ValueError):
    """A table or server setting out of its range; the message names the setting."""

    reason = Reason.INVALID_CONFIG


class SpecError(InvalidRequest):
    """A sample request is malformed; the message names the field and its allowed range."""


class NotFound(StoreError):
    """No such table, lease, grant or experience."""

    status = "NOT_FOUND"
    reason = Reason.NOT_FOUND


class Conflict(StoreError):
    """A uid pushed again with other bytes, or a table that exists with other settings."""

    status = "ALREADY_EXISTS"
    reason = Reason.CONFLICT


class Forbidden(StoreError):
    """A lease, or a prompt's claim, taken by another token."""

    status = "PERMISSION_DENIED"
    reason = Reason.FORBIDDEN


def taken_with(taken: str, caller: str) -> str:
    """Whose a lease, grant or claim is, that `caller` may not use: `taken` and `caller` are
    fingerprints of tokens, "" where the server had tokens off. Where the server's tokens were
    turned off or on since (a restart), it says so: no token the caller could find would do."""
    if taken and not caller:
        return (
            "a token while this server had tokens on, which are off now: turn them on again to use it"
            " with that token, or let it expire"
        )
    if caller and not taken:
        return "no token while this server had tokens off, which are on now: no token can use it; let it expire"
    return "another token"


class GroupClosed(StoreError):
    """The group's or table's state refuses it now: a push into a complete group."""

    status = "FAILED_PRECONDITION"
    reason = Reason.GROUP_CLOSED


class GroupOverfilled(GroupClosed):
    """A push that would give a group more experiences than the table's group_size."""

    reason = Reason.GROUP_OVERFILLED


class StaleExperience(GroupClosed):
    """A push carries an experience older than the table's staleness bound (on_stale = refuse)."""

    reason = Reason.STALE


class StaleAttempt(GroupClosed):
    """A push into the group of a prompt's attempt that no claim holds: its claim ended, or it
    was never handed out (the prompt ledger)."""

    reason = Reason.STALE_ATTEMPT


class GroupIncomplete(StoreError):
    """A group asked to retire as trained before it is complete (pending, or its advantages computing)."""

    status = "FAILED_PRECONDITION"
    reason = Reason.GROUP_INCOMPLETE


class VersionJump(GroupClosed):
    """A trainer version beyond what the table's data allows, with evict_stale on."""


class TableFull(StoreError):
    """The table has no room now; a blocking table's pusher may wait for room."""

    status = "RESOURCE_EXHAUSTED"
    reason = Reason.TABLE_FULL


class TooLarge(StoreError):
    """A push larger than the table's whole capacity, or a group larger than a reply: waiting would never help."""

    status = "RESOURCE_EXHAUSTED"
    reason = Reason.TOO_LARGE


class StorageFull(StoreError):
    """The disk or the map cannot grow to hold the write."""

    status = "RESOURCE_EXHAUSTED"
    reason = Reason.STORAGE_FULL


class InsertLimited(StoreError):
    """An insert held by the rate limit until its deadline."""

    status = "RESOURCE_EXHAUSTED"
    reason = Reason.RATE_LIMITED


class SampleLimited(StoreError):
    """A sample held by the rate limit until its deadline."""

    status = "DEADLINE_EXCEEDED"
    reason = Reason.RATE_LIMITED


class Busy(StoreError):
    """A read that more reads at once kept from holding a snapshot: nothing was done; read again."""

    status = "RESOURCE_EXHAUSTED"
    reason = Reason.BUSY


class ReplyLetGo(StoreError):
    """A reply its client read none of while the store had to end its snapshot (a map resize, too
    many open), with no room under max_inflight_bytes to copy the rest: its call ends, and its
    batch goes back to the buffer, as a broken stream's does."""

    status = "RESOURCE_EXHAUSTED"
    reason = Reason.REPLIES_FULL


class IndexNotReady(StoreError):
    """A request that reads an index its table is still building in the background
    (index_builds.py), whose wait ended before the build did: asked again later, it is served."""

    status = "DEADLINE_EXCEEDED"
    reason = Reason.INDEX_BUILDING


class Cancelled(StoreError):
    """A call its caller gave up on, stopped before it wrote anything (a long CreateDataset)."""

    status = "CANCELLED"
    reason = Reason.CANCELLED


class Damaged(StoreError):
    """A data directory whose records cannot be trusted (a damaged page); `expbuf check` says where."""

    status = "DATA_LOSS"
    reason = Reason.DAMAGED

    def __init__(self, path: object, damage: str) -> None:
        super().__init__(f"damaged ({damage}); run `expbuf check --data {path}`")
        self.damage = damage


class DamagedPayload(StoreError):
    """A stored experience found damaged where its batch's reply was built (one stored in chunks
    is checked there, off the writer: chunk_reads.Deferred); its batch was not sent."""

    status = "DATA_LOSS"
    reason = Reason.DAMAGED

    def __init__(self, uid: str, why: str) -> None:
        super().__init__(f"experience {uid}: {why}")
        self.uid = uid


class BatchStageFailed(StoreError):
    """A table's batch stage raised over a sampled batch (an estimator's bug that some data trips):
    the groups it raises on alone fail, each with why (`failed`: group -> why), or every group of
    the batch where none does alone (the batch together trips it). Left in the buffer, they would be
    taken, and fail, again and again: the table would serve nothing more."""

    def __init__(self, failed: dict[str, str], error: Exception) -> None:
        named = ", ".join(clip(gkey) for gkey in list(failed)[:8])
        more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
        raised = f"{type(error).__name__}: {clip(str(error), 200)}"
        super().__init__(f"the table's batch stage raised {raised}, over group(s) {named}{more}")
        self.failed = failed


def stage_error(error: BaseException) -> str:
    """What a batch stage raised, as a failed group's last failure names it."""
    return f"its batch stage raised {type(error).__name__}: {clip(str(error), 200)}"


# The way out of a group whose record does not decode, which its refusals and logs name.
DROP_DAMAGED_GROUP = (
    "run `expbuf check` on the data directory; Delete the group by its id to remove it with its experiences"
)


class DamagedGroup(StoreError):
    """A rows table's pending or computing group whose head (its directory entry) no longer decodes,
    or is lost (`lost`: an index still names the group), met by a request that changes or ends it:
    what it holds cannot be read, so nothing of the request is stored, and `expbuf check` names the
    group. A Delete naming such a group by its id removes it whole (core/verbs/rows/deletes.py), which
    the refusal says where the entry is a pending or computing group's (`pending`), not a complete
    group's place, which its segment still holds."""

    status = "DATA_LOSS"
    reason = Reason.DAMAGED

    def __init__(self, gkey: str, why: str, *, pending: bool = True, lost: bool = False) -> None:
        way_out = DROP_DAMAGED_GROUP if pending else "run `expbuf check` on the data directory"
        what = "is not stored" if lost else "does not decode"
        super().__init__(
            f"group {clip(gkey)}: its record {what} ({why}; damaged on disk): nothing of this request "
            f"is stored; {way_out}"
        )
        self.gkey, self.why = gkey, why


class DamagedPiece(StoreError):
    """A piece of a rollout held in pieces lost, or not the one pushed (its size and digest, taken at
    its push, are in its rollout's head), or that head no longer decoding (`number` None), found as
    the rollout was read: the rollout cannot be finished from its pieces, which the store drops
    (rules/partial_holds.drop_damaged)."""

    status = "DATA_LOSS"
    reason = Reason.DAMAGED

    def __init__(self, uid: str, number: int | None, why: str) -> None:
        self.piece = "" if number is None else f", piece {number}"  # what of the rollout is damaged
        super().__init__(
            f"partial rollout {clip(uid)}{self.piece}: {why} (damaged on disk): nothing of this push is "
            "stored, and the rollout's pieces are dropped; push the rollout again from its first piece"
        )
        self.uid, self.number, self.why = uid, number, why


class StoreClosed(StoreError):
    """The store is closing or closed: the server is stopping."""

    status = "UNAVAILABLE"
    reason = Reason.CLOSED


class AdvantagesUnavailable(StoreError):
    """The advantage worker could not start (torch did not load): a fault of the server,
    INTERNAL, which clients do not retry (advantages/start.py)."""

    reason = Reason.ADVANTAGES_UNAVAILABLE
