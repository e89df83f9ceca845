"""A torch IterableDataset over expbuf batches, for trainer loops.

    dataset = ExperienceDataset(BufferClient(), num_groups=32, delivery="lease")
    for batch in torch.utils.data.DataLoader(dataset, batch_size=None):
        train_step(batch.experiences)

Each item is one Batch (whole groups). A leased batch is acknowledged when the next one is
requested, i.e. once the training step that used it has returned, before the next one is waited
for: its lease covers the step alone, not the wait for rollouts after it (a step longer than
`lease_seconds` raises NotFoundError naming the setting). If the trainer dies mid-step the lease
expires and the batch goes back to the buffer; a loop left mid-batch (an exception in the step,
or `break`) gives the batch back at once, so call `ack_held()` before a `break` that follows a
finished step. The client decodes the next batch while the step runs (`prefetch`, 1 by default;
pass prefetch=0 among the sample arguments to decode each when it is requested). Use it with
`batch_size=None` and `num_workers=0`: the client holds a gRPC channel, which a DataLoader's
worker processes can neither be handed (spawn) nor share (fork); a worker's iteration is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NoReturn

import torch.utils.data

from .client import Batch, BufferClient
from .errors import ExpbufError, NotFoundError

IN_A_WORKER = (
    "ExperienceDataset is iterated in the main process only: use DataLoader(..., num_workers=0) (the client"
    " holds a gRPC channel, which a worker process can neither be handed nor share; the client decodes the"
    " next batch while the step runs, so workers would add nothing)"
)


class ExperienceDataset(torch.utils.data.IterableDataset):
    def __init__(self, client: BufferClient, table: str = "default", **sample_args: Any) -> None:
        super().__init__()
        self.client = client
        self.table = table
        self.sample_args = {"delivery": "lease", **sample_args}
        self._held: Batch | None = None  # the batch handed to the step under way

    def set_trainer_version(self, version: int) -> int:
        """Tell the table the trainer's policy version, e.g. after each optimizer step."""
        return self.client.set_trainer_version(version, self.table)

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(IN_A_WORKER)

    def __iter__(self) -> Iterator[Batch]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(IN_A_WORKER)
        batches = self.client.sample(self.table, **self.sample_args)
        try:
            while True:
                self.ack_held()  # the step is done: acknowledged before the next batch is waited for
                batch = next(batches, None)
                if batch is None:
                    return
                self._held = batch
                yield batch
        finally:
            held, self._held = self._held, None
            if held is not None:  # left mid-batch (an exception in the step, a break): given back now
                with contextlib.suppress(ExpbufError):  # one whose lease ended is back already
                    held.nack()
            batches.close()

    def ack_held(self) -> int:
        """Acknowledge the batch handed to the step under way (its step done): before a `break` out
        of the loop, which otherwise gives it back to be trained again. 0 where none is held."""
        held, self._held = self._held, None
        if held is None:
            return 0
        try:
            return held.ack()
        except NotFoundError as exc:  # its lease ended: expired, most likely
            seconds = self.sample_args.get("lease_seconds")
            lease = f"lease_seconds = {seconds}" if seconds else "the default lease_seconds"
            raise NotFoundError(
                exc.code,
                f"{exc.details} (ExperienceDataset: where the training step outlasted the batch's lease, {lease},"
                " pass lease_seconds longer than a step among its sample arguments)",
                exc.reason,
            ) from None
