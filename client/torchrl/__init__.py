"""expbuf as a TorchRL replay-buffer storage (needs torchrl; `import expbuf.client` never loads this).

rb = ReplayBuffer(storage=ExpbufStorage("10.0.0.5:50051", "grpo8"), sampler=ExpbufSampler(), batch_size=32)
rb.extend(data)        # TorchRL LLM TensorDicts, pushed as experiences (LLMCollector(replay_buffer=rb) does it)
batch = rb.sample()    # whole groups, leased, with the table's "advantage"; acknowledged at the next sample
"""

from __future__ import annotations

from .convert import to_element, to_experience
from .sampler import ExpbufSampler
from .storage import ExpbufStorage

__all__ = ["ExpbufSampler", "ExpbufStorage", "to_element", "to_experience"]
