"""verl's V1 trainer on expbuf as TransferQueue's backend, by configuration only
(tests/verl_tq_child.py: verl's `run_ppo` and `TaskRunnerV1`, its own Hydra config with the
lines of docs/frameworks/verl.md). On a machine without GPUs verl goes as far as its resource-pool
check; before it, its TaskRunner has started TransferQueue from `config.transfer_queue`, in a Ray
worker where the runtime_env's setup hook registered expbuf: the backend's table and the
controller's journal are in the server."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from expbuf.client import BufferClient

from helpers import ServerProcess

# Found, not imported: the test runs verl in a child, and verl's import cost every pytest worker,
# which collects every module, seconds of CPU.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None or importlib.util.find_spec("transfer_queue") is None,
    reason="verl or TransferQueue is not installed",
)

CHILD = Path(__file__).parent / "verl_tq_child.py"


def test_verls_own_trainer_starts_transfer_queue_on_expbuf_from_its_config(tmp_path: Path) -> None:
    server = ServerProcess(str(tmp_path / "data"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        done = subprocess.run(
            [sys.executable, str(CHILD), server.target, "verl_tq", str(tmp_path)],
            capture_output=True, text=True, timeout=600, env=env, check=False,
        )  # fmt: skip
        out = done.stdout + done.stderr
        assert server.proc.poll() is None, "".join(server.log)
        assert done.returncode != 0 and "Total available GPUs 0 is less than total desired GPUs 1" in out, out[-6000:]
        assert "train and validate dataloader initialized" in out, out[-6000:]  # past tq.init and the data
        with BufferClient(server.target) as client:
            tables = {table.name for table in client.list_tables()}
        assert {"verl_tq", "verl_tq_controller"} <= tables  # the backend's values and the controller's journal
    finally:
        server.stop(signal.SIGTERM)
