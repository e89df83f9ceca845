"""expbuf client side: the TRXP codec, experience types and the gRPC clients."""

from .aio import AsyncBufferClient
from .client import BufferClient
from .connection import Tls
from .errors import (
    AlreadyExistsError,
    BufferError,
    DataLossError,
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
from .prompts import Claim, DatasetInfo, EpochCounts, Prompt, PromptPage
from .results import (
    Batch,
    BufferStats,
    GetResult,
    PushResult,
    ScrubInfo,
    ServerInfo,
    ShapingInfo,
    TableInfo,
    TableStats,
)
from .trxp import TrxpError, decode, encode

__all__ = [
    "EID",
    "AlreadyExistsError",
    "AsyncBufferClient",
    "Batch",
    "BufferClient",
    "BufferError",
    "BufferStats",
    "Claim",
    "DataLossError",
    "DatasetInfo",
    "DeadlineExceededError",
    "EpochCounts",
    "ExpbufError",
    "Experience",
    "FailedPreconditionError",
    "GetResult",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "Prompt",
    "PromptPage",
    "PushResult",
    "ResourceExhaustedError",
    "ScrubInfo",
    "ServerInfo",
    "ShapingInfo",
    "TableInfo",
    "TableStats",
    "Tls",
    "TrxpError",
    "UnauthenticatedError",
    "UnavailableError",
    "decode",
    "encode",
]
