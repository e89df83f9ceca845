"""Trinity-RFT readers through the plug-in, against an `expbuf serve` child: slow explorers, killed trainers.

Two explorers push one group at a time, slower than a trainer's batch fills within one of the
reader's polls (the reader checks each second whether the writers are done). Every read of a
table with a fixed group size holds exactly `batch_size` experiences until the last explorer
releases (issue: a read returned what was there after a second, and the trainer stepped on a
fraction of its batch); every experience is read once.

A trainer's reader in a child process, in the middle of a read that waits for more groups,
keeps the groups it has taken past several leases while it lives, and once it is killed they
return within a lease (issue: a killed reader left its groups leased for an hour).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest
import torch

from expbuf.client import BufferClient

from test_trinity_plugin import plugin, until  # noqa: F401 - loads the plugin as Trinity does


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity, ExperienceBufferConfig, EID, Experience, plugin_dir
    import test_trinity_plugin

    test_trinity_plugin.import_frameworks()
    trinity = pytest.importorskip("trinity")
    from trinity.common.config import ExperienceBufferConfig
    from trinity.common.experience import EID, Experience

    from expbuf.client.trinity import plugin_dir


pytestmark = pytest.mark.faults

EXPLORERS = 2
GROUPS = 12  # per explorer
PAUSE = 0.5  # seconds between an explorer's writes: a batch takes several of the reader's polls


def runs(explorer: int, task: int, size: int) -> list[Experience]:
    return [
        Experience(
            eid=EID(batch=explorer, task=task, run=run),
            tokens=torch.arange(6, dtype=torch.int32),
            prompt_length=2,
            logprobs=torch.full((4,), -0.5),
            reward=float(run),
            info={"model_version": task},
        )
        for run in range(size)
    ]


@pytest.mark.parametrize(
    ("settings", "size", "batch_size", "query"),
    [
        ({"group_by": "task", "group_size": 4}, 4, 32, ""),
        ({"group_by": "none"}, 1, 8, "delivery=consume"),
    ],
    ids=["group_size_4_lease", "group_by_none_consume"],
)
def test_reads_are_whole_batches_while_explorers_push_slowly(
    child_server, settings: dict, size: int, batch_size: int, query: str
) -> None:
    server, table = child_server, f"slow_{settings['group_by']}"  # the module's server, a table of its own
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(table, estimator="none", **settings)
    path = f"expbuf://127.0.0.1:{server.port}/{table}" + (f"?{query}" if query else "")
    config = ExperienceBufferConfig(name="experience_buffer", path=path, batch_size=batch_size, max_read_timeout=60.0)
    open_writers, lock, last_releasing = [EXPLORERS], threading.Lock(), threading.Event()
    failed: list[BaseException] = []

    def explorer(number: int) -> None:
        async def run() -> None:
            writer = trinity.buffer.get_buffer_writer(config)
            await writer.acquire()
            for task in range(GROUPS):
                await writer.write(runs(number, task, size))
                await asyncio.sleep(PAUSE)
            with lock:
                open_writers[0] -= 1
                if not open_writers[0]:
                    last_releasing.set()
            await writer.release()

        try:
            asyncio.run(run())
        except BaseException as exc:
            failed.append(exc)

    writers = [threading.Thread(target=explorer, args=(n,)) for n in range(EXPLORERS)]
    reader = trinity.buffer.get_buffer_reader(config)
    for thread in writers:
        thread.start()
    reads: list[tuple[list[Experience], bool]] = []
    try:
        while True:
            try:
                got = asyncio.run(reader.read())
            except StopAsyncIteration:
                break
            reads.append((got, last_releasing.is_set()))
    finally:
        for thread in writers:
            thread.join(timeout=120)
    assert not failed
    before_the_end = [len(got) for got, ended in reads if not ended]
    assert len(before_the_end) >= 2
    assert before_the_end == [batch_size] * len(before_the_end)
    read_uids = Counter(exp.eid.uid for got, _ in reads for exp in got)
    assert len(read_uids) == EXPLORERS * GROUPS * size and set(read_uids.values()) == {1}
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        stats = admin.stats(table)[table]
    assert (stats.ready, stats.consumed + stats.leased) == (0, EXPLORERS * GROUPS * size)


TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    from trinity.utils.plugin_loader import load_plugins
    load_plugins()  # from TRINITY_PLUGIN_DIRS, as Trinity's trainer actor does
    import trinity.buffer
    from trinity.common.config import ExperienceBufferConfig

    config = ExperienceBufferConfig(name="experience_buffer", path=sys.argv[1], batch_size=64, max_read_timeout=600.0)
    reader = trinity.buffer.get_buffer_reader(config)
    print("reading", flush=True)
    asyncio.run(reader.read())  # 12 of 64 experiences are there: it waits for more
    """
)


def test_a_killed_readers_groups_return_within_a_lease(child_server) -> None:
    server = child_server  # the module's server (a reader is killed here, not the server), a table of its own
    lease = 1.0
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table("agent", group_size=0, estimator="grpo")
        admin.writers("agent", 1)  # an explorer is open: the read waits for a whole batch
        admin.push(Experience.serialize_many([e for task in range(3) for e in runs(0, task, 4)]), "agent")

        def counts() -> tuple[int, int, int]:
            stats = admin.stats("agent")["agent"]
            return stats.ready, stats.leased, stats.leases_expired

        path = f"expbuf://127.0.0.1:{server.port}/agent?lease_seconds={lease}"
        env = {**os.environ, "TRINITY_PLUGIN_DIRS": plugin_dir()}
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            assert until(lambda: counts()[:2] == (0, 12)), trainer.stderr.read() if trainer.poll() is not None else ""
            time.sleep(4 * lease)  # the read waits on, four leases long
            assert counts() == (0, 12, 0)
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(30)
            assert until(lambda: counts()[:2] == (12, 0))
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
