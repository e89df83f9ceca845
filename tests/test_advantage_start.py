"""torch loads after the server listens (server/advantages/start.py): the server's modules import
no torch; a push that computes its advantages waits for the worker and is stored as before; and
where torch cannot load, the server still serves what needs no advantages and refuses by name
each push that does."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expbuf.client import BufferClient, InvalidArgumentError, trxp
from expbuf.client.errors import ExpbufError

from conftest import Servers
from helpers import ServerProcess, group_items, make_experience, pythonpath

SERVER_MODULES = "expbuf.server.app", "expbuf.server.cli", "expbuf.server.rpc.service", "expbuf.server.rpc.metrics"


def test_the_servers_modules_import_no_torch() -> None:
    code = f"import sys\nfor m in {SERVER_MODULES!r}: __import__(m)\nprint('torch' in sys.modules)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0 and child.stdout.strip() == "False", child.stderr


def test_a_push_right_after_the_start_has_its_advantages(tmp_path: Path) -> None:
    server = ServerProcess(str(tmp_path / "data"), warm=False)  # the push may come before torch has loaded
    try:
        with BufferClient(server.target, timeout=60) as client:
            client.create_table("g", group_size=4, estimator="grpo")
            runs = [make_experience(0, 0, run, reward=float(run)) for run in range(4)]
            client.push(runs, table="g")
            assert client.stats("g")["g"].ready == 4  # computed in the push, which waited for the worker
            (batch,) = client.sample("g", num_groups=1, max_batches=1, delivery="consume")
            firsts = sorted(float(e.advantages.flatten()[0]) for e in batch.experiences)
            assert firsts[0] < 0 < firsts[-1]  # GRPO's: rewards 0..3 around their mean
            assert client.server_info().advantage_device == "cpu"
    finally:
        server.stop(signal.SIGTERM)


def test_a_server_whose_torch_cannot_load_serves_what_needs_none(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    server = ServerProcess(str(tmp_path / "data"), env={"PYTHONPATH": pythonpath(broken)})
    try:
        with BufferClient(server.target, timeout=60) as client:
            client.create_table("plain", group_size=2, estimator="none")
            client.push(trxp.build(group_items(0, 0, 2)), table="plain")
            (batch,) = client.sample("plain", num_groups=1, max_batches=1, delivery="consume")
            assert len(batch.uids) == 2
            client.create_table("g", group_size=2, estimator="grpo")
            with pytest.raises(ExpbufError, match="advantages cannot be computed on this server") as refused:
                client.push(trxp.build(group_items(1, 0, 2)), table="g")
            assert not isinstance(refused.value, InvalidArgumentError)
            assert "this torch is broken on purpose" in str(refused.value)
            assert client.stats("g")["g"].pushed == 0  # stored nothing
            assert client.server_info().advantage_device == ""
    finally:
        server.stop(signal.SIGTERM)
    assert sum("advantage worker did not start" in line for line in server.log) == 1, "".join(server.log)


def test_what_the_server_loaded_at_its_start_is_out_of_the_collectors_sight(start_server: Servers) -> None:
    """Once torch has loaded, the server freezes its heap (gc.freeze): a full collection, which
    the records of takes and pushes bring on, then walks only what was made since."""
    before = gc.get_freeze_count()
    live = [[] for _ in range(10_000)]  # tracked objects that are alive when the server freezes
    server = start_server()
    deadline = time.monotonic() + 120
    while not server.service.advantage_device:
        assert time.monotonic() < deadline, "the advantage worker did not start"
        time.sleep(0.05)
    try:
        assert gc.get_freeze_count() >= before + len(live)
    finally:
        gc.unfreeze()  # this test process's objects, frozen with the server's
