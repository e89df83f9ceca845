"""A torch IterableDataset over expbuf batches, for trainer loops.

    dataset = ExperienceDataset(BufferClient(), num_groups=32, delivery="lease")
    for batch in torch.utils.data.DataLoader(dataset, batch_size=None):
        train_step(batch.experiences)

Each item is one Batch (whole groups). A leased batch is acknowledged when the next
one is requested, i.e. once the training step that used it has returned; if the
trainer dies mid-step the lease expires and the batch goes back to the buffer. The
client decodes the next batch while the step runs (`prefetch`, 1 by default; pass
prefetch=0 among the sample arguments to decode each when it is requested).
Use it with `batch_size=None` and `num_workers=0` (the client holds a gRPC channel).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from .client import Batch, BufferClient


class ExperienceDataset(torch.utils.data.IterableDataset):
    def __init__(self, client: BufferClient, table: str = "default", **sample_args: Any) -> None:
        super().__init__()
        self.client = client
        self.table = table
        self.sample_args = {"delivery": "lease", **sample_args}

    def set_trainer_version(self, version: int) -> int:
        """Tell the table the trainer's policy version, e.g. after each optimizer step."""
        return self.client.set_trainer_version(version, self.table)

    def __iter__(self) -> Iterator[Batch]:
        previous: Batch | None = None
        try:
            for batch in self.client.sample(self.table, **self.sample_args):
                if previous is not None:
                    previous.ack()
                previous = batch
                yield batch
            if previous is not None:
                previous.ack()
                previous = None
        finally:
            if previous is not None:  # iteration abandoned mid-batch: give it back now
                previous.nack()
