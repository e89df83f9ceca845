"""The storage engine imports no torch: opening a store, pushing and sampling from a table
with a batch stage leave torch unloaded; the stage, which the store is given, runs where the
reply is built."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, make_experience

CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from expbuf.client import trxp
    from expbuf.server.advantages.batch_stage import finish_batch
    from expbuf.server.store.schema.sample_spec import TakeSpec
    from expbuf.server.store import Store

    data = Path(sys.argv[1])
    with Store(data, batch_stage=finish_batch) as store:
        result = store.put("w", trxp.parse((data / "more.trxp").read_bytes()))
        assert len(result.stored) == 4, result
        batch = store.sample(TakeSpec("w", num_groups=2, wait_seconds=0))
        assert batch is not None and len(batch.uids) == 8 and batch.stage is not None
        loaded = [name for name in sys.modules if name == "torch" or name.startswith("torch.")]
        assert not loaded, loaded
        advantages = [e.tensors["advantages"] for e in trxp.parse(batch.payload)]  # the stage runs here
        assert len(advantages) == 8, advantages
        assert "torch" in sys.modules
        stats = store.stats("w")  # the stage's clip, counted in memory
        assert (stats["advantages_seen"], stats["advantages_clipped"]) == (8, 4), stats
    print("torch-free")
    """
)


def test_open_push_and_sample_from_a_batch_stage_table_import_no_torch(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(
            TableConfig.of("w", group_size=4, estimator="reinforce++_baseline", shaping={"advantage_clip": 0.5})
        )
        runs = [make_experience(1, task, run, reward=float(run)) for task in (0, 1) for run in range(4)]
        store.put("w", [trxp.from_experience(e) for e in runs])  # values r - mean: +-0.5, +-1.5
        assert AdvantageWorker(store).run_once() == 2
    (tmp_path / "more.trxp").write_bytes(trxp.build(group_items(2, 0, 4, reward=3.0)))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0 and child.stdout.strip() == "torch-free", child.stderr


def test_a_store_given_no_batch_stage_takes_no_batch_of_a_table_that_needs_one(tmp_path: Path) -> None:
    """Its stored values are pending ones, not advantages: a sample is refused and takes
    nothing, and so is a Get."""
    refused = r"table 'w' finishes its advantages over each sampled batch, .* \(Store\(batch_stage=\.\.\.\)\)"
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("w", group_size=2, estimator="reinforce++_baseline"))
        store.put("w", group_items(1, 0, 2, reward=1.0) + group_items(1, 1, 2, reward=2.0))
        assert AdvantageWorker(store).run_once() == 2
        with pytest.raises(StoreError, match=refused):
            store.sample(TakeSpec("w", num_groups=1))
        assert store.stats("w")["ready"] == 4
        with pytest.raises(StoreError, match=refused):
            store.get_payload("w", ["1/0/0/0/r0s0"])


LOADED = "import sys, expbuf.server.store\n{then}print(sorted(set(sys.argv[1:]) & set(sys.modules)))"


def test_importing_the_store_loads_no_grpc_no_client_and_no_torch() -> None:
    """The store reads payloads with the codec, expbuf.client.trxp: importing it runs
    expbuf.client's __init__, whose clients (and grpc) load only when first named."""
    watched = ["grpc", "torch", "expbuf.client.client", "expbuf.client.aio"]
    for then, loaded in (("", []), ("from expbuf.client import BufferClient\n", ["expbuf.client.client", "grpc"])):
        source = LOADED.format(then=then)
        child = subprocess.run(
            [sys.executable, "-c", source, *watched], capture_output=True, text=True, timeout=120, check=False
        )
        assert child.returncode == 0 and child.stdout.strip() == str(loaded), (child.stdout, child.stderr)
