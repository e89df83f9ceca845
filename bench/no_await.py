"""Run a benchmark with the client's consume streams made as before they awaited delivery, for a
side-by-side measure of what the wait costs (bench/RESULTS.md, "A consumed batch handed over once
delivered"): `SampleSpec.request` leaves `awaits_delivery` unset; the server is the same.

    .venv/bin/python bench/no_await.py bench/bench_stream_8k.py [its arguments]
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from expbuf.client.rpc import sample_spec
from expbuf.proto.v1 import buffer_pb2 as pb

_request = sample_spec.SampleSpec.request


def _unawaited(self: sample_spec.SampleSpec, max_reply_bytes: int, **keywords: Any) -> pb.SampleRequest:
    message = _request(self, max_reply_bytes, **keywords)
    message.awaits_delivery = False
    return message


if __name__ == "__main__":
    sample_spec.SampleSpec.request = _unawaited  # type: ignore[method-assign]
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
