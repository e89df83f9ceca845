"""TRL's AsyncGRPOTrainer on a CPU, for the TRL tests: a tiny model made here, and where the line is.

The trainer needs CUDA in exactly two places, and these tests put a CPU equivalent in each:
- `AsyncGRPOTrainer.__init__` reads the GPU's name for its MFU metric
  (`get_peak_flops_per_device` calls `torch.cuda.get_device_name`): here it answers None,
  TRL's own answer for a device whose peak it does not know (MFU is then not logged);
- its forward's tree attention calls the FlashAttention-3 kernel from the Hugging Face Hub
  (`packing._flash_attn`, a CUDA kernel fetched at first use): here `varlen_attention`, the
  same varlen causal attention over the same `tree_kv_index`/`cu_seqlens` in torch.
The weight sync to a vLLM server (NCCL) is left out through TRL's own seam, a no-op
`weight_transfer` (WeightTransferProtocol), since no vLLM server runs here. Everything else
(the trainer, its queue dataset, batchers, packing, collator, loss, optimizer and callbacks)
is TRL's, unchanged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


def import_frameworks() -> None:
    """TRL and transformers imported by the test modules that use this one (their
    import_frameworks): not at the import, which every pytest worker does for those modules."""
    global trl, trainer_module, packing, Tokenizer, models, pre_tokenizers, PreTrainedTokenizerFast, Qwen2Config
    global Qwen2ForCausalLM
    trl = pytest.importorskip("trl")
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


VOCAB = 256
EOS, PAD = 1, 2
# Token ids from here on name a sample: each test experience carries one in its completion, so
# the trainer's packed inputs say which samples a micro-batch trained.
MARKS = 16


class varlen_attention:
    """What TRL calls of the FlashAttention kernel, in torch: each segment's queries attend
    causally (aligned at the end) over its path of keys and values."""

    @staticmethod
    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        **_: Any,
    ) -> torch.Tensor:
        assert causal and window_size == (-1, -1)
        out = torch.empty_like(q)
        heads = q.shape[1] // k.shape[1]
        for s in range(cu_seqlens_q.numel() - 1):
            q0, q1, k0, k1 = (
                int(x) for x in (cu_seqlens_q[s], cu_seqlens_q[s + 1], cu_seqlens_k[s], cu_seqlens_k[s + 1])
            )
            keys = k[k0:k1].repeat_interleave(heads, dim=1).transpose(0, 1)
            values = v[k0:k1].repeat_interleave(heads, dim=1).transpose(0, 1)
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(diagonal=(k1 - k0) - (q1 - q0))
            attended = torch.nn.functional.scaled_dot_product_attention(
                q[q0:q1].transpose(0, 1), keys, values, attn_mask=mask, scale=softmax_scale
            )
            out[q0:q1] = attended.transpose(0, 1)
        return out


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """The two CPU equivalents above, in place while the block runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packing, "_flash_attn", lambda: varlen_attention)
        patch.setattr(trainer_module, "get_peak_flops_per_device", lambda accelerator, dtype: None)
        yield


class NoWeightSync:
    """TRL's WeightTransferProtocol with nothing to send to (no vLLM server here)."""

    def init_weight_transfer(self) -> None: ...
    def pause(self) -> None: ...
    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...


def tiny_model(directory: Path) -> str:
    """A 2-layer Qwen2 of 256 tokens and its tokenizer, made from a config and saved in
    `directory` (nothing downloaded); the path, which TRL takes as the model."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{EOS}", pad_token=f"t{PAD}", unk_token="t0")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return str(directory)


def trained_marks(inputs: dict[str, torch.Tensor]) -> list[int]:
    """The sample marks among the tokens a training step's packed inputs forward."""
    tokens = inputs["input_ids"][inputs["attention_mask"].bool()]
    return sorted(int(t) - MARKS for t in tokens.unique() if int(t) >= MARKS)


def until(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    """Whether `condition` holds within `seconds` (a bound for a broken run, not a timing)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
