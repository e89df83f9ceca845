"""expbuf client side: the TRXP codec, experience types and the gRPC clients."""

from .client import AsyncBufferClient, Batch, BufferClient, GetResult, PushResult, Tls
from .errors import (
    AlreadyExistsError,
    BufferError,
    DeadlineExceededError,
    ExpbufError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from .experience import EID, Experience
from .trxp import TrxpError, decode, encode

__all__ = [
    "EID",
    "AlreadyExistsError",
    "AsyncBufferClient",
    "Batch",
    "BufferClient",
    "BufferError",
    "DeadlineExceededError",
    "ExpbufError",
    "Experience",
    "FailedPreconditionError",
    "GetResult",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "PushResult",
    "ResourceExhaustedError",
    "Tls",
    "TrxpError",
    "UnauthenticatedError",
    "UnavailableError",
    "decode",
    "encode",
]
