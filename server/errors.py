"""The refusals of the storage engine, each naming the gRPC status it maps to, and
`clip`, which keeps untrusted input out of messages and logs at a bounded length."""

from __future__ import annotations

CLIP = 100


def clip(value: object, limit: int = CLIP) -> str:
    """`value` as text of at most about `limit` characters, saying how long it was."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class StoreError(Exception):
    """A refused request; `code` names the gRPC status it maps to."""

    code = "internal"


class InvalidRequest(StoreError):
    code = "invalid_argument"


class NotFound(StoreError):
    code = "not_found"


class Conflict(StoreError):
    code = "already_exists"


class Forbidden(StoreError):
    code = "permission_denied"


class GroupClosed(StoreError):
    code = "failed_precondition"


class TableFull(StoreError):
    """The table has no room now; a blocking table's pusher may wait for room."""

    code = "resource_exhausted"


class TooLarge(StoreError):
    """A push larger than the table's whole capacity: waiting would never help."""

    code = "resource_exhausted"


class StorageFull(StoreError):
    code = "resource_exhausted"


class Damaged(StoreError):
    """A data directory whose records cannot be trusted (a damaged page); `expbuf check` says where."""

    code = "data_loss"

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"damaged ({reason}); run `expbuf check --data {path}`")
        self.reason = reason


class StoreClosed(StoreError):
    code = "unavailable"
