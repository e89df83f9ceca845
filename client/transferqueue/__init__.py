"""expbuf for the frameworks on TransferQueue (verl's V1 trainer, NeMo-RL, ROLL).

`ExpbufBalancedSampler`: TransferQueue's sampler slot (`controller.sampler` in its config),
splitting each step's whole groups over the data-parallel ranks with expbuf's split
(schema/balance.py) instead of its own Karmarkar-Karp. The storage backend "Expbuf"
(`backend.storage_backend`, storage.py): each (sample, field) kept durably in an expbuf table,
registered with TransferQueue when this package is imported, and TransferQueue's controller
kept in expbuf with it (`DurableController`, controller.py). Needs `transferqueue` (the `verl`
extra).
"""

from .controller import DurableController
from .sampler import ExpbufBalancedSampler
from .storage import ExpbufStorageClient, ExpbufStorageManager

__all__ = ["DurableController", "ExpbufBalancedSampler", "ExpbufStorageClient", "ExpbufStorageManager"]


def setup() -> None:
    """Ray's `worker_process_setup_hook` for a job whose workers start TransferQueue themselves
    (verl's `ray_kwargs.ray_init.runtime_env.worker_process_setup_hook`): Ray imports this package
    in each worker before anything else runs there, which registers the backend and the controller;
    nothing is left to do."""
