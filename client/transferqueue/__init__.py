"""expbuf for the frameworks on TransferQueue (verl's V1 trainer, NeMo-RL, ROLL).

`ExpbufBalancedSampler`: TransferQueue's sampler slot (`controller.sampler` in its config),
splitting each step's whole groups over the data-parallel ranks with expbuf's split
(schema/balance.py) instead of its own Karmarkar-Karp. Needs `transferqueue` (the `verl` extra).
"""

from .sampler import ExpbufBalancedSampler

__all__ = ["ExpbufBalancedSampler"]
