"""The errors the clients raise: one base, `ExpbufError`, and one subclass per status a caller handles.

Each subclass names its status in `status`; those attributes are the one table from status
code to class (`ExpbufError.for_status`). `ExpbufError(code, details)` builds the subclass of
its status code, so every place that turns a gRPC status into an error gives the same types,
and a caller can write `except NotFoundError:` instead of comparing codes. `BufferError`, the
old name of the base, stays for one release; it shadows Python's builtin of that name, so new
code uses `ExpbufError`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc


class ExpbufError(Exception):
    """A refused or failed call; `code` is the grpc.StatusCode and `details` the server's message."""

    status: ClassVar[grpc.StatusCode | None] = None
    # The experiences of a pipelined push that failed (see Pusher), for a caller that pushes them again.
    uids: tuple[str, ...] = ()
    # The server refused the call as having done nothing, as many calls as it lets in (or lets
    # wait) being in progress: the same call later may get in (a waiting claim or admit, and a
    # push, are made again: calls.Attempts, pipeline.py).
    busy: bool = False
    # Why the server refused the call (client/schema/reasons.py, a `Reason` value): what code acts
    # on, never the message's words. None where no expbuf server said (an older server, a proxy,
    # a failure on this side).
    reason: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> ExpbufError:
        # The base made with a status is that status's subclass. Any other arguments are taken as
        # they come: Ray raises a task's error as a class of its own over the error's, made from
        # the error alone (RayTaskError.as_instanceof_cause), so that `except UnavailableError` holds.
        if cls is ExpbufError and args and isinstance(args[0], grpc.StatusCode):
            cls = ExpbufError.for_status(args[0])
        return super().__new__(cls)

    def __init__(self, code: grpc.StatusCode, details: str, reason: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason

    @staticmethod
    def for_status(code: grpc.StatusCode) -> type[ExpbufError]:
        """The subclass whose `status` is `code`; the base itself for a status no subclass handles."""
        return next((kind for kind in ExpbufError.__subclasses__() if kind.status == code), ExpbufError)

    def __reduce__(self) -> tuple[Any, ...]:
        # its class, message and attributes (code, details, reason, busy, uids, a ShardError's
        # shards): an error that crossed a process (Ray, multiprocessing) is the same error
        return (_rebuilt, (type(self), self.args), self.__dict__)


class InvalidArgumentError(ExpbufError):
    """A refused payload or setting: the message names the item and field. Retrying cannot help."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(ExpbufError):
    """No such table, lease or grant."""

    status = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ExpbufError):
    """A uid pushed again with different bytes, or a table that exists with other settings."""

    status = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(ExpbufError):
    """The table's state refuses it now: a push into a complete group, a stale push refused."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(ExpbufError):
    """A full table or disk, a limit on calls or message size, or the rate limiter holding a push."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(ExpbufError):
    """Not enough data (or room) came before the call's deadline."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(ExpbufError):
    """The server did not answer, after the client's retries."""

    status = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(ExpbufError):
    """A missing, malformed or unknown token."""

    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ExpbufError):
    """The token lacks the method's scope, or the lease belongs to another token."""

    status = grpc.StatusCode.PERMISSION_DENIED


class DataLossError(ExpbufError):
    """A sampled batch this client could not decode. It was not confirmed: it goes back to the
    buffer (a leased one is not leased, a consumed one not consumed) and the message names it.
    Also damage the server found on disk (reason `damaged`), naming what it found: a stored
    experience (quarantined), or a piece of a rollout held in pieces, whose last piece's push is
    refused so, its pieces dropped: push the rollout again from its first piece."""

    status = grpc.StatusCode.DATA_LOSS


def _rebuilt(kind: type[ExpbufError], args: tuple[Any, ...]) -> ExpbufError:
    """An error of `kind` with its message, its attributes set after (pickle's state): no
    subclass's __init__, whatever it takes, is called again."""
    error = Exception.__new__(kind)
    error.args = args
    return error


BufferError = ExpbufError
