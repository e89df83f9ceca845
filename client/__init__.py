"""expbuf client side: the TRXP codec, experience types and the gRPC clients."""

from .client import AsyncBufferClient, Batch, BufferClient, BufferError, GetResult, PushResult, Tls
from .experience import EID, Experience
from .trxp import TrxpError, decode, encode

__all__ = [
    "EID",
    "AsyncBufferClient",
    "Batch",
    "BufferClient",
    "BufferError",
    "Experience",
    "GetResult",
    "PushResult",
    "Tls",
    "TrxpError",
    "decode",
    "encode",
]
