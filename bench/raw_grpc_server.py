"""A gRPC server with no storage, for the service benchmark's transport baseline.

/bench.Raw/Push takes bytes and answers a few bytes (/bench.Raw/Read too, taking its request as a
stream of one, as expbuf's Push does); /bench.Raw/Stream answers
`count` messages of `size` bytes (request: b"count,size"). Same thread pool and
message limits as expbuf serve.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc

MAX = 256 << 20


def push(request: bytes, context: grpc.ServicerContext) -> bytes:
    return len(request).to_bytes(8, "little")


def read(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    """Push's answer, its one message read by the handler as a stream of one (as expbuf's Push is,
    read only once admitted: server/rpc/push/push_memory.py)."""
    return push(next(requests), context)


def stream(request: bytes, context: grpc.ServicerContext):
    count, size = map(int, request.split(b","))
    message = os.urandom(size)
    for _ in range(count):
        yield message


def main() -> None:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64),
        options=[("grpc.max_receive_message_length", MAX), ("grpc.max_send_message_length", MAX)],
    )
    handlers = {
        "Push": grpc.unary_unary_rpc_method_handler(push),
        "Read": grpc.stream_unary_rpc_method_handler(read),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
