"""A TorchRL writer and trainer on an `expbuf serve` child that is SIGKILLed in the middle of the run.

The writer extends its own ReplayBuffer (an ExpbufStorage) one group at a time; the trainer
samples a ReplayBuffer of its own with the ExpbufSampler, a batch per step, each acknowledged
when the next is asked for. The server is killed while both run, twice (after the trainer's
first steps: as it acknowledges a step, and while it waits in a draw), and restarted each time
on the same data and port. Every element whose `extend` returned is
trained, and no element is trained twice: a draw the kill interrupted goes back, an ack the
kill left unanswered is not taken for a lost lease, and the leases of the batch in training
survive the restart.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter

import pytest
import torch

from expbuf.client import BufferClient, DeadlineExceededError

from faultkit import scaled


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global TensorDict, lazy_stack, set_list_to_stack, ReplayBuffer, LogProbs, Tokens, ExpbufSampler
    global ExpbufStorage
    pytest.importorskip("torchrl")
    from tensordict import TensorDict, lazy_stack, set_list_to_stack
    from torchrl.data import ReplayBuffer
    from torchrl.modules.llm.policies import LogProbs, Tokens

    from expbuf.client.torchrl import ExpbufSampler, ExpbufStorage


pytestmark = pytest.mark.faults

GROUPS = 24
RUNS = 4
PACE = 0.2  # seconds between the writer's groups: the trainer waits in its draws most of the time
KILLS = scaled(2)  # even kills land as the trainer acknowledges a step, odd ones while it waits in a draw


def group(number: int) -> TensorDict:
    """RUNS turns of prompt `number`, each response distinct."""
    turns = []
    for run in range(RUNS):
        prompt, response = torch.tensor([1, 2, number]), torch.tensor([number, run, 7])
        turns.append(
            TensorDict(
                {
                    "tokens": Tokens(prompt=prompt, response=response, padded=False, batch_size=[]),
                    "log_probs": LogProbs(response=torch.full((3,), -0.5), padded=False, batch_size=[]),
                    "query": f"prompt {number}",
                    ("next", "reward"): torch.tensor([[float(run)]]),
                },
                batch_size=[],
            )
        )
    return lazy_stack(turns)


def test_a_server_killed_mid_run_loses_nothing_acknowledged_and_trains_nothing_twice(serve, tmp_path) -> None:
    data = str(tmp_path / "data")
    server = serve(data)
    target = server.target
    with BufferClient(target) as admin:
        admin.create_table("rl", group_size=RUNS, estimator="grpo")
    acknowledged: list[tuple[str, int]] = []
    trained: list[tuple[str, int]] = []
    steps = threading.Condition()
    writer_done = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        with set_list_to_stack(True):
            rb = ReplayBuffer(storage=ExpbufStorage(target, "rl"))
            for number in range(GROUPS):
                data = group(number)
                try:
                    rb.extend(data)
                except BaseException as exc:  # not acknowledged: it may or may not be stored
                    failures.append(exc)
                    continue
                acknowledged.extend((f"prompt {number}", run) for run in range(RUNS))
                threading.Event().wait(PACE)
        writer_done.set()

    def kill_and_restart() -> None:
        nonlocal server
        for kill in range(KILLS):
            with steps:
                if not steps.wait_for(lambda kill=kill: len(trained) >= (kill + 1) * 2 * RUNS, timeout=300):
                    return  # the trainer is stuck: the assertions below say so
            if kill % 2:
                threading.Event().wait(PACE / 2)  # the writer's next group is not there yet
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)
            server = serve(data, "--port", str(server.port))

    threads = [threading.Thread(target=write), threading.Thread(target=kill_and_restart)]
    for thread in threads:
        thread.start()
    with set_list_to_stack(True):
        rb = ReplayBuffer(storage=ExpbufStorage(target, "rl"), sampler=ExpbufSampler(timeout=5), batch_size=RUNS)
        while not (writer_done.is_set() and not threads[1].is_alive() and set(acknowledged) <= set(trained)):
            try:
                batch = rb.sample()
            except DeadlineExceededError:
                continue
            with steps:
                trained.extend((td["query"], int(td["tokens", "response"][1])) for td in batch.unbind(0))
                steps.notify_all()
        rb.sampler.ack()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert len(acknowledged) == GROUPS * RUNS
    twice = [element for element, count in Counter(trained).items() if count > 1]
    assert not twice, f"trained twice: {twice}"
    assert set(trained) == set(acknowledged)
    with BufferClient(server.target) as admin:
        table = admin.stats("rl")["rl"]
    assert (table.ready, table.leased, table.pending, table.consumed) == (0, 0, 0, GROUPS * RUNS)
