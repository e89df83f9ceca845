"""TRL's AsyncGRPOTrainer trains from an `expbuf serve` child that is SIGKILLed in the middle of
the run and restarted on the same data and port, while the trainer goes on (tests/trl_cpu.py:
a tiny model on the CPU).

Every sample carries a mark token, so the trainer's own packed inputs say what it trained.
After the run: no sample was trained twice, the table consumed exactly what was trained
(nothing acknowledged is lost, nothing trained is left to be trained again), what was not
trained is back in the table, the server's counts agree, and `expbuf check` passes. Training
waits for the restarted server before it ends: the worker acks what the last steps trained when
TRL stops it, and a server still down then leaves those acks unmade (their leases end, and a
later run trains those groups again), so consumed == trained could not be asserted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_trl_trainer import GROUP, push_groups, recording_trainer

from expbuf.client import BufferClient, ExpbufError

from faultkit import servers
from helpers import ServerProcess
from trl_cpu import on_cpu, tiny_model, until


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global TrainerCallback, AsyncGRPOConfig, ExpbufRolloutWorker, KillTheServer
    import test_trl_trainer

    test_trl_trainer.import_frameworks()  # trl_cpu's too
    pytest.importorskip("trl")
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from expbuf.client.trl import ExpbufRolloutWorker

    class KillTheServer(TrainerCallback):
        """SIGKILL the server at the end of step KILL_AT; a thread starts it again on its port, and
        training does not end before the worker's client reaches it again."""

        def __init__(self, server: ServerProcess, restart: Callable[[], ServerProcess], client: BufferClient) -> None:
            self.server, self.restart, self.client = server, restart, client
            self.killed = threading.Event()
            self.back = threading.Event()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step != KILL_AT:
                return
            self.server.proc.send_signal(signal.SIGKILL)
            self.server.proc.wait(30)
            self.killed.set()

            def start_again() -> None:
                self.back.wait(DOWN_SECONDS)  # an event no one sets yet: a pause the trainer does not wait for
                self.server = self.restart()
                self.back.set()

            threading.Thread(target=start_again, daemon=True).start()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """The worker acks what the last steps trained when TRL stops it, right after this: wait
            until the restarted server answers the worker's own client, so that those acks can be made."""
            self.back.wait(RESTART_SECONDS)
            until(lambda: answers(self.client), RESTART_SECONDS)


pytestmark = pytest.mark.faults

STEPS = 8
KILL_AT = 3  # the step after whose end the server is killed
DOWN_SECONDS = 1.0  # then restarted this long after, whatever the trainer is doing
RESTART_SECONDS = 120.0  # a bound on the restart, for a broken run


def answers(client: BufferClient) -> bool:
    """Whether the server answers through `client` (its channel reconnected)."""
    try:
        client.server_info()
    except ExpbufError:
        return False
    return True


def test_a_server_killed_mid_run_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    model = tiny_model(tmp_path / "model")
    data = str(tmp_path / "data")
    with servers() as start:
        server = start(data)
        port = server.port
        with BufferClient(server.target) as client:
            client.create_table("grpo", group_size=GROUP)
            uids = push_groups(client, "grpo", STEPS + 4)
            worker = ExpbufRolloutWorker(client, "grpo", num_groups=1, wait_seconds=0.5, lease_seconds=120)
            args = AsyncGRPOConfig(
                output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=GROUP,
                max_staleness=STEPS + 1, token_budget=0, report_to="none", save_strategy="no", use_cpu=True,
                disable_tqdm=True, heartbeat_stale_after_s=120,  # a server that never comes back fails the run
            )  # fmt: skip
            kill = KillTheServer(server, lambda: start(data, "--port", str(port)), client)
            with on_cpu():
                trainer = recording_trainer(model, args, worker, kill)
                trainer.train()

            assert kill.killed.is_set() and kill.back.is_set(), "the server was not killed and restarted mid-run"
            assert trainer.state.global_step == STEPS
            marks = [mark for step in trainer.trained for mark in step]
            assert len(marks) == len(set(marks)), (
                f"samples trained twice: {sorted(m for m in marks if marks.count(m) > 1)}"
            )
            live = {e.uid: e.state for e in client.list_experiences("grpo").experiences}
            gone = {mark for uid, mark in uids.items() if uid not in live}
            assert not gone - set(marks), (
                f"acknowledged experiences neither in the table nor trained: {gone - set(marks)}"
            )
            assert gone == set(marks), f"trained, yet not acknowledged: {sorted(set(marks) - gone)}"
            assert set(live.values()) == {"ready"}, (
                f"the worker gave back every lease it held when training ended: {live}"
            )
            stats = client.stats("grpo")["grpo"]
            assert (stats.pushed, stats.consumed, stats.ready) == (len(uids), len(marks), len(uids) - len(marks))
        assert kill.server.stop(signal.SIGTERM) == 0
    checked = subprocess.run(
        [sys.executable, "-m", "expbuf.server.cli", "check", "--data", data],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, f"expbuf check after the run:\n{checked.stdout}{checked.stderr}"
