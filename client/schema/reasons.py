"""Why the server refused a call: one stable name per cause, sent beside the refusal's message.

The server puts a refusal's reason in the call's status as gRPC's rich error detail
(`google.rpc.ErrorInfo` with domain `expbuf`, client/rpc/wire.py), and counts it as the `reason`
label of `expbuf_refused_total`. The clients read it into `ExpbufError.reason`, so code that acts
on a refusal compares a reason, never the wording of a message. A reason is never renamed; a new
cause gets a new one.
"""

from __future__ import annotations

from enum import StrEnum

DOMAIN = "expbuf"


class Reason(StrEnum):
    """Every reason a refusal can carry (docs: Reference, Refusals)."""

    INTERNAL = "internal"  # a fault of the server's, logged there with its traceback
    INVALID_REQUEST = "invalid_request"  # a field of the request out of its range or form
    INVALID_PAYLOAD = "invalid_payload"  # a push's payload is not valid TRXP, or breaks the table's rules
    INVALID_CONFIG = "invalid_config"  # a table's or a dataset's settings
    NOT_FOUND = "not_found"  # no such table, lease, grant, dataset or claim
    CONFLICT = "conflict"  # a uid pushed again with other bytes; a table that exists with other settings
    FORBIDDEN = "forbidden"  # the token lacks the method's scope, or the thing belongs to another token
    UNAUTHENTICATED = "unauthenticated"  # no token, or one the server does not know
    GROUP_CLOSED = "group_closed"  # a push into a group that is complete
    GROUP_OVERFILLED = "group_overfilled"  # a push that would give a group more than group_size experiences
    STALE = "stale"  # an experience older than the table's staleness bound (on_stale = refuse)
    STALE_ATTEMPT = "stale_attempt"  # a push into the group of a prompt's attempt that no claim holds
    GROUP_INCOMPLETE = "group_incomplete"  # a group retired as trained before it is complete
    TABLE_FULL = "table_full"  # the table is at its capacity and blocks (when_full = block), or pushes stage it full
    TOO_LARGE = "too_large"  # a message, payload or reply over the server's bound, or a reply over the client's
    STORAGE_FULL = "storage_full"  # the data directory's map or disk is full
    RATE_LIMITED = "rate_limited"  # the table's rate limiter holds the push or the sample
    INDEX_BUILDING = "index_building"  # the order's index is still being built after an upgrade
    CANCELLED = "cancelled"  # the caller went away
    DAMAGED = "damaged"  # a stored experience failed its check on read
    CLOSED = "closed"  # the store is closing
    ADVANTAGES_UNAVAILABLE = "advantages_unavailable"  # the advantage worker is not running
    BUSY = "busy"  # as many calls as the server lets in (or lets wait) are in progress: nothing was done
    SHUTTING_DOWN = "shutting_down"  # the server is stopping; another replica, or this one restarted, takes the call
    NOT_READY = "not_ready"  # a Sample did not find enough ready groups within its wait
    UNCONFIRMED = "unconfirmed"  # a Sample stream's batch was not confirmed within max_confirm_seconds
    IDLE = "idle"  # a PushStream sent nothing for push_stream_idle_seconds, a Sample stream no request
    TOO_SLOW = "too_slow"  # a push in chunks came slower than push_min_mb_per_second
    CUT_SHORT = "cut_short"  # a push in chunks ended short of its total_bytes, or skipped an offset: a chunk never came
    INFLIGHT_FULL = "inflight_full"  # pushes and PutValues in progress held max_inflight_bytes the whole wait
    REPLIES_FULL = "replies_full"  # replies of reads their clients have not taken hold the server's bound
    STREAMS_FULL = "streams_full"  # max_table_streams Sample streams are open on the table
