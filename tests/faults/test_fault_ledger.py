"""The prompt ledger under SIGKILL: every prompt of every epoch is trained exactly once.

An `expbuf serve` child holds a table grouping by task and a dataset of PROMPTS prompts x
EPOCHS epochs. Two rollout-worker processes and one trainer process (ledger_roles.py, the
public client API only) work through it while, for ROUNDS rounds, one of the four (a worker,
the trainer or the server) is SIGKILLed at a random moment and restarted: the workers and the
trainer as new processes, the server on the same data directory and address. Claims last
CLAIM_SECONDS, so a killed worker's prompts come back (attempt + 1) within the test.

At the end the ledger counts every (epoch, index) trained and none dropped; the trainer's log,
written to disk before each ack, shows that no prompt's group reached the trainer after it
was acked, that a group came again only after a delivery whose ack was not confirmed (the last
batch of a killed trainer, or an ack a server kill cut short or outlasted), that no prompt had
two attempts' groups delivered and no group mixed attempts; and `expbuf check` finds the
stopped directory consistent.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from expbuf.client import BufferClient

from faultkit import check_data, scaled
from helpers import ServerProcess
from ledger_roles import CLAIM_SECONDS, DATASET, GROUP, TABLE

pytestmark = pytest.mark.faults

ROUNDS = scaled(4)  # each role killed once (the server, two workers, the trainer); more with EXPBUF_SOAK_SCALE
PROMPTS = scaled(48)
EPOCHS = 3
ROLES = Path(__file__).with_name("ledger_roles.py")


class Role:
    """A worker's or the trainer's process, started again under a new name after each kill."""

    def __init__(self, kind: str, base: str, target: str, workdir: Path) -> None:
        self.kind, self.base, self.target, self.workdir = kind, base, target, workdir
        self.killed: list[str] = []
        self.start()

    def start(self) -> None:
        self.name = f"{self.base}.{len(self.killed)}"
        with (self.workdir / f"{self.name}.out").open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROLES), self.kind, self.target, str(self.workdir), self.name],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        """Wait until this process has reached the server: a kill before would land in its start-up."""
        deadline = time.monotonic() + 60
        while not (self.workdir / f"{self.name}.ready").exists():
            assert self.proc.poll() is None, f"{self.name} exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"{self.name} did not start:\n{self.output()}"
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.killed.append(self.name)
        self.start()

    def output(self) -> str:
        return (self.workdir / f"{self.name}.out").read_text()


@pytest.fixture
def roles() -> Iterator[list[Role]]:
    started: list[Role] = []
    yield started
    for role in started:
        if role.proc.poll() is None:
            role.proc.send_signal(signal.SIGKILL)
            role.proc.wait(30)


@dataclass
class Delivery:
    """A batch the trainer logged, and the outcome of its ack (None: the trainer was killed first)."""

    name: str
    groups: dict[str, list[list]]
    outcome: str | None = None
    last_of_its_trainer: bool = False


@dataclass
class TrainerLog:
    deliveries: list[Delivery] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> TrainerLog:
        log = cls()
        open_: dict[tuple[str, str], Delivery] = {}
        last: dict[str, Delivery] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            key = (record["name"], record["lease"])
            if "groups" in record:
                delivery = Delivery(record["name"], record["groups"])
                log.deliveries.append(delivery)
                open_[key] = last[record["name"]] = delivery
            else:
                open_.pop(key).outcome = record["ack"]
        for delivery in last.values():
            delivery.last_of_its_trainer = True
        return log


def attempt_of(gid: str) -> tuple[int, int, int]:
    """(epoch, index, attempt) of a prompt's group id `prompts/EPOCH/INDEX@ATTEMPT`."""
    name, epoch, task = gid.split("/")
    index, attempt = task.split("@")
    assert name == DATASET, gid
    return int(epoch), int(index), int(attempt)


def check_trainer_log(log: TrainerLog, trainers_killed: set[str], server_kills: int) -> dict[tuple[int, int], str]:
    """Assert what the trainer saw; returns each prompt's one group that reached it."""
    unanswered = [d for d in log.deliveries if d.outcome is None]
    for delivery in unanswered:  # logged, then killed before the ack's outcome was logged
        assert delivery.last_of_its_trainer and delivery.name in trainers_killed, (
            f"trainer {delivery.name} logged no outcome for a batch that was not its last before a kill"
        )
    cut = [d for d in log.deliveries if d.outcome not in (None, "acked")]
    assert all(d.outcome == "not_found" for d in cut), Counter(d.outcome for d in cut)
    # A server kill leaves the trainer at most the batch in hand and the one on its way (the
    # client's window of 2): each may be acked after the server's restart and not found.
    assert len(cut) <= 2 * server_kills, f"{len(cut)} acks not found, but the server was killed {server_kills} times"

    by_group: dict[str, list[Delivery]] = {}
    for delivery in log.deliveries:
        for gid, members in delivery.groups.items():
            by_group.setdefault(gid, []).append(delivery)
            epoch, index, attempt = attempt_of(gid)
            batch, task = f"{DATASET}/{epoch}", f"{index}@{attempt}"
            assert all(m[:2] == [batch, task] for m in members), f"group {gid} mixes attempts: {members}"
            assert sorted(m[2] for m in members) == list(range(GROUP)), f"group {gid} came with runs {members}"
    for gid, seen in by_group.items():
        acked = [i for i, d in enumerate(seen) if d.outcome == "acked"]
        assert acked in ([], [len(seen) - 1]), (
            f"group {gid} reached the trainer {len(seen)} times, acked at deliveries {acked}: "
            "a group came again after its ack was confirmed"
        )
    groups: dict[tuple[int, int], str] = {}
    for gid in by_group:
        epoch, index, _ = attempt_of(gid)
        other = groups.setdefault((epoch, index), gid)
        assert other == gid, f"two attempts of prompt {epoch}/{index} reached the trainer: {other} and {gid}"
    return groups


@pytest.mark.soak
def test_every_prompt_trained_once_through_kills_of_every_role(
    tmp_path: Path, serve: Callable[..., ServerProcess], roles: list[Role]
) -> None:
    started = time.monotonic()
    rng = random.Random(28)
    data, workdir = tmp_path / "data", tmp_path / "work"
    workdir.mkdir()
    server = serve(str(data))
    port, target, total = server.port, server.target, PROMPTS * EPOCHS
    with BufferClient(target, timeout=30) as client:
        client.create_table(TABLE, group_size=GROUP)
        client.create_dataset(TABLE, DATASET, PROMPTS, epochs=EPOCHS, seed=28, max_in_flight=8, max_attempts=1000)
    roles += [Role("worker", f"worker{i}", target, workdir) for i in range(2)]
    roles.append(Role("trainer", "trainer", target, workdir))
    by_name = {role.base: role for role in roles}

    every = ["server", *by_name]  # each in turn, in a new random order every len(every) rounds
    victims = [victim for _ in range(0, ROUNDS, len(every)) for victim in rng.sample(every, len(every))][:ROUNDS]
    kills: Counter[str] = Counter()
    for round_, victim in enumerate(victims):
        if victim in by_name:
            by_name[victim].wait_ready()
        time.sleep(rng.uniform(0.2, 1.2))
        if round_ == len(victims) - 1:  # the last kill still lands in a run that is not done
            with BufferClient(target, timeout=30) as client:
                assert client.ledger(TABLE, DATASET).total("trained") < total, "the run ended before the kills did"
        if victim == "server":
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)
            server = serve(str(data), "--port", str(port))
        else:
            by_name[victim].kill()
        kills[victim] += 1

    (workdir / "finish").touch()  # no more pauses: the rest of the run goes at full speed
    for role in roles:
        try:
            code = role.proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{role.name} did not finish:\n{role.output()}")
        assert code == 0, f"{role.name} exited with {code}:\n{role.output()}"

    with BufferClient(target, timeout=30) as client:
        info = client.ledger(TABLE, DATASET)
        listed = client.list_prompts(TABLE, DATASET, limit=total + 1)
        stats = client.stats(TABLE)[TABLE]
    assert info.done and [c.trained for c in info.counts] == [PROMPTS] * EPOCHS, info.counts
    assert (info.total("dropped"), info.total("claimed"), info.total("generated"), info.total("pending")) == (0,) * 4
    assert listed.done and len(listed.prompts) == total
    assert {(p.epoch, p.index) for p in listed.prompts} == {(e, i) for e in range(EPOCHS) for i in range(PROMPTS)}
    assert {p.state for p in listed.prompts} == {"trained"}
    assert stats.ready == stats.leased == stats.pending == 0, stats

    log = TrainerLog.read(workdir / "trainer.log")
    delivered = check_trainer_log(log, set(by_name["trainer"].killed), kills["server"])
    trained = {(p.epoch, p.index): p.group for p in listed.prompts}
    assert delivered == trained, "the group of a prompt's trained attempt never reached the trainer"

    assert server.stop(signal.SIGTERM) == 0
    checked = check_data(data)
    assert checked.returncode == 0, f"expbuf check after the crash matrix:\n{checked.stdout}{checked.stderr}"

    events = Counter(line.split()[0] for path in workdir.glob("*.events") for line in path.read_text().splitlines())
    again = sum(len(d.groups) for d in log.deliveries) - len(delivered)
    print(
        f"\nledger crash matrix: {ROUNDS} rounds, kills {dict(kills)}, {total} prompts ({PROMPTS} x {EPOCHS} epochs), "
        f"{info.reissued} claims re-issued, {info.attempts_dropped} incomplete attempts dropped, "
        f"{events['refused']} stale pushes refused, {events['ended']} claims found ended, "
        f"{len(log.deliveries)} batches to the trainer ({again} groups again after an unconfirmed ack), "
        f"claims of {CLAIM_SECONDS:g} s, {time.monotonic() - started:.0f} s"
    )
