"""expbuf for the frameworks on TransferQueue (verl's V1 trainer, NeMo-RL, ROLL).

`ExpbufBalancedSampler`: TransferQueue's sampler slot (`controller.sampler` in its config),
splitting each step's whole groups over the data-parallel ranks with expbuf's split
(schema/balance.py) instead of its own Karmarkar-Karp. The storage backend "Expbuf"
(`backend.storage_backend`, storage.py): each (sample, field) kept durably in an expbuf table,
registered with TransferQueue when this package is imported. Needs `transferqueue` (the `verl`
extra).
"""

from .sampler import ExpbufBalancedSampler
from .storage import ExpbufStorageClient, ExpbufStorageManager

__all__ = ["ExpbufBalancedSampler", "ExpbufStorageClient", "ExpbufStorageManager"]
