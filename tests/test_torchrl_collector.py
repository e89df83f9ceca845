"""TorchRL's LLM path on the CPU with expbuf as its replay buffer's storage.

A one-layer Llama built from a config and a character tokenizer built here (nothing is
downloaded) generate through TorchRL's TransformersWrapper in a ChatEnv (text mode, groups of
four runs of one prompt, as `group_repeats` makes them); LLMCollector(replay_buffer=...) writes
every turn into the expbuf table; the sampled batch feeds TorchRL's GRPOLoss, scored by a second
TransformersWrapper, and the loss back-propagates. Where the line is: TorchRL's vLLM and SGLang
wrappers, its Ray collectors and weight updaters need CUDA; this path uses none of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from expbuf.client import BufferClient


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global TensorDict, TensorDictBase, lazy_stack, set_list_to_stack, Tokenizer, decoders, models
    global pre_tokenizers, LLMCollector, ReplayBuffer, Unbounded, Transform, ChatEnv, TransformersWrapper
    global GRPOLoss, MCAdvantage, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, ExpbufSampler
    global ExpbufStorage, ResponseLength
    pytest.importorskip("torchrl")
    pytest.importorskip("transformers")
    from tensordict import TensorDict, TensorDictBase, lazy_stack, set_list_to_stack
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import ReplayBuffer, Unbounded
    from torchrl.envs import Transform
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss, MCAdvantage
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from expbuf.client.torchrl import ExpbufSampler, ExpbufStorage

    class ResponseLength(Transform):
        """The reward of a turn: its response's length in characters, in the (1, 1) shape of
        TorchRL's reward parsers; every turn ends its dialog."""

        def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
            texts = tensordict["text", "response"]
            texts = [texts] if isinstance(texts, str) else list(texts)
            done = torch.ones(len(texts), 1, dtype=torch.bool)
            next_tensordict.set("reward", torch.tensor([float(len(t)) for t in texts]).reshape(-1, 1, 1))
            next_tensordict.set("done", done)
            next_tensordict.set("terminated", done.clone())
            return next_tensordict

        def transform_reward_spec(self, reward_spec):
            reward_spec["reward"] = Unbounded((*reward_spec.shape, 1, 1))
            return reward_spec


RUNS = 4  # runs of each prompt: a group
PROMPTS = 3
WORDS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "\n", *"abcdefghijklmnopqrstuvwxyz0123456789"]


@pytest.fixture(autouse=True)
def _stack_lists() -> Iterator[None]:
    with set_list_to_stack(True):
        yield


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, built here."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    return LlamaForCausalLM(config)


class Prompts:
    """A dataloader of one prompt per draw, repeated for a group."""

    def __init__(self) -> None:
        self.count = 0

    def __iter__(self) -> Prompts:
        return self

    def __next__(self) -> dict[str, list[str]]:
        self.count += 1
        return {"query": [f"abc{self.count}"] * RUNS}


def turn(td: TensorDictBase) -> TensorDict:
    """A sampled element as a finished one-turn trajectory, as MCAdvantage takes it."""
    fields = {"query": td["query"], ("next", "reward"): td["next", "reward"], ("next", "done"): torch.tensor([True])}
    return TensorDict(fields, batch_size=[])


def advantages_by_query(data: TensorDictBase) -> dict[str, torch.Tensor]:
    """Each group's advantages, sorted (the two sides order a group's runs differently)."""
    found: dict[str, list[float]] = {}
    for td in data.unbind(0):
        found.setdefault(td["query"], []).append(float(td["advantage"].reshape(())))
    return {query: torch.tensor(sorted(values)) for query, values in found.items()}


def test_llm_collector_writes_into_expbuf_and_grpo_trains_on_its_groups(start_server) -> None:
    target = f"127.0.0.1:{start_server().port}"
    with BufferClient(target) as admin:
        admin.create_table("llm", group_size=RUNS, estimator="grpo")
        tk, model = tokenizer(), tiny_llama()
        env = ChatEnv.from_dataloader(
            dataloader=Prompts(), batch_size=(RUNS,), group_repeats=True, input_mode="text", tokenizer=tk
        ).append_transform(ResponseLength())
        policy = TransformersWrapper(
            model,
            tokenizer=tk,
            input_mode="text",
            generate=True,
            return_log_probs=True,
            generate_kwargs={"max_new_tokens": 8, "do_sample": True},
        )
        rb = ReplayBuffer(storage=ExpbufStorage(target, "llm"), sampler=ExpbufSampler(timeout=10), batch_size=2 * RUNS)
        collector = LLMCollector(
            env=env,
            policy=policy,
            dialog_turns_per_batch=RUNS,
            total_dialog_turns=PROMPTS * RUNS,
            replay_buffer=rb,
            track_policy_version=True,
        )
        assert list(collector) == [None] * PROMPTS  # it writes into the buffer, yields nothing
        table = admin.stats("llm")["llm"]
        assert (table.pushed, table.groups_ready, table.max_model_version) == (PROMPTS * RUNS, PROMPTS, 0)

        batch = rb.sample()
        assert Counter(batch["query"]) == dict.fromkeys(set(batch["query"]), RUNS) and len(set(batch["query"])) == 2
        for td in batch.unbind(0):  # the tokens are the generated ones, decoded to the text
            assert tk.decode(td["tokens", "response"]) == td["text", "response"]
        # TorchRL's own MCAdvantage on the same rewards gives the table's advantage
        turns = lazy_stack([turn(td) for td in batch.unbind(0)])
        reference = advantages_by_query(MCAdvantage(grpo_size=RUNS, prompt_key="query").inv(turns))
        ours = advantages_by_query(batch)
        assert ours.keys() == reference.keys()
        for query, values in reference.items():
            torch.testing.assert_close(ours[query], values, rtol=1e-5, atol=1e-6)

        scorer = TransformersWrapper(model, tokenizer=tk, input_mode="tokens", generate=False, return_log_probs=True)
        loss = GRPOLoss(actor_network=scorer, masking_strategy="sft")(batch)
        total = loss.loss_objective + loss.loss_entropy
        assert bool(torch.isfinite(total))
        total.backward()
        assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
        rb.sampler.ack()  # the step is done (no sample follows to say so)
        table = admin.stats("llm")["llm"]
        assert (table.consumed, table.leased, table.ready) == (2 * RUNS, 0, RUNS)
