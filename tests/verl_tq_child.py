"""verl's own entry, `run_ppo` with its `TaskRunnerV1`, on expbuf as TransferQueue's backend by
configuration only: verl's ppo_trainer config composed by Hydra and the YAML lines of
docs/frameworks/verl.md ("expbuf behind TransferQueue") merged in (the server's address and the
table set), a model of one layer and a tokenizer made here (no network), and a
dataset of eight prompts. verl starts Ray with the config's runtime_env, its TaskRunner calls
`tq.init(config.transfer_queue)`, builds the tokenizer and the dataloaders, and stops at the
first thing that needs a GPU: its resource-pool check.

usage: verl_tq_child.py TARGET TABLE WORKDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

from pages import code_blocks, page


def model_dir(root: Path) -> Path:
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    path = root / "model"
    fast.save_pretrained(path)
    Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(path)  # fmt: skip
    return path


def dataset(root: Path) -> Path:
    rows = [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": "w1 w2 w3"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "w4"},
            "extra_info": {"index": i},
        }
        for i in range(8)
    ]
    path = root / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def main() -> None:
    target, table, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    model, train = model_dir(root), dataset(root)
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model}",
                f"data.train_files={train}",
                f"data.val_files={train}",
                "data.train_batch_size=4",
                "data.max_prompt_length=16",
                "data.max_response_length=8",
                "data.dataloader_num_workers=0",
                "trainer.n_gpus_per_node=1",
                "trainer.logger=[console]",
                "ray_kwargs.ray_init.num_cpus=2",
                "+ray_kwargs.ray_init.include_dashboard=false",
            ],
        )
    section = page("frameworks/verl.md").split("## expbuf behind TransferQueue")[1]
    docs = OmegaConf.create(code_blocks(section, "yaml")[0])  # the page's lines, as a user adds them
    docs.transfer_queue.backend.Expbuf.target = target
    docs.transfer_queue.backend.Expbuf.table = table
    OmegaConf.set_struct(config, False)
    config = OmegaConf.merge(
        config, docs, {"transfer_queue": {"controller": {"Expbuf": {"table": f"{table}_controller"}}}}
    )
    run_ppo(config, task_runner_class=TaskRunnerV1)


if __name__ == "__main__":
    main()
