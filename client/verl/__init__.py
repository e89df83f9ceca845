"""expbuf as verl V1's replay buffer (needs verl and transferqueue; `import expbuf.client` never loads this).

    trainer.v1.sampler.custom_sampler: {path: expbuf.client.verl, name: ExpbufReplayBuffer}
    trainer.v1.sampler.sampler_kwargs.expbuf: {target: HOST:PORT, table: NAME, mode: mirror | source}

Importing it (VERL_USE_EXTERNAL_MODULES=expbuf.client.verl does so in every verl process)
registers the trainer `expbuf_external` and the advantage estimator `expbuf`.
"""

from __future__ import annotations

from .advantage import compute_expbuf_advantage
from .convert import Row, from_verl, to_verl
from .replay_buffer import ExpbufReplayBuffer
from .settings import Settings
from .trainer import ExpbufExternalTrainer

__all__ = [
    "ExpbufExternalTrainer",
    "ExpbufReplayBuffer",
    "Row",
    "Settings",
    "compute_expbuf_advantage",
    "from_verl",
    "to_verl",
]
