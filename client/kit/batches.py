"""One batch whose delivery the server has stored: the one way an adapter takes a batch.

The server stores a batch's delivery (its lease, or its consumption) and then ends the stream of a
request for one batch. An adapter that kept the batch as soon as it arrived could, were the
server killed in between, train groups that the restarted server still holds as ready and hands
out again. So the batch is the caller's only once its stream has ended normally; a stream that
breaks after the batch came raises, and the batch goes to `give_back` (its lease may have been
stored: given back, its groups are ready again at once rather than when it ends). A replayed
batch whose stream broke is read again by the next take; a consumed one may be gone, as a consumed
batch is once delivered whatever the trainer does next (consume is at most once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

from expbuf.client.client import BufferClient
from expbuf.client.errors import ExpbufError
from expbuf.client.kit.retry import retried
from expbuf.client.results import Batch
from expbuf.client.rpc.sample_spec import SampleOptions


def take_one(
    client: BufferClient,
    table: str,
    give_back: Callable[[Batch], object],
    *,
    batch_size: int | None = None,
    num_groups: int | None = None,
    retry_for: float = 0.0,
    **options: Unpack[SampleOptions],
) -> Batch | None:
    """One batch of whole groups, delivered durably; None when the stream ended without one (a
    partial request finding nothing ready). A request that no batch met within its `timeout`
    raises DeadlineExceededError, as `sample` does. With `retry_for`, a take that finds the server
    unavailable (a restart) is made again for that many seconds (kit.retry.retried), as the
    adapters wait for a server that restarts."""
    one: SampleOptions = {"window": 1, **options}
    one["max_batches"] = 1

    def take() -> Batch | None:
        got: list[Batch] = []
        try:
            for batch in client.sample(table, batch_size, num_groups, **one):
                got.append(batch)
        except ExpbufError:
            for batch in got:
                if batch.lease_id:
                    give_back(batch)
            raise
        return got[0] if got else None

    return retried(take, retry_for)
