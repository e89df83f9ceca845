"""Kill -9 a process writing through the store, again and again; nothing acknowledged is lost."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from expbuf.client import decode
from expbuf.server.store import Store

from helpers import pythonpath

HERE = Path(__file__).parent
# Each kill lands at a random moment of three writers' commits and is checked on its own;
# EXPBUF_SOAK_SCALE=100 for a long run.
KILLS = 8 * int(os.environ.get("EXPBUF_SOAK_SCALE", "1"))


def _run_until_killed(data: Path, run: int, rng: random.Random) -> list[str]:
    """Start a writer, let it commit for a random while, SIGKILL it; return the uids it saw acknowledged."""
    env = {**os.environ, "PYTHONPATH": pythonpath(HERE)}
    child = subprocess.Popen(
        [sys.executable, str(HERE / "crash_writer.py"), str(data), str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    acked: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in child.stdout:
            acked.extend(json.loads(line))
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    if not started.wait(60):
        child.kill()
        raise AssertionError(f"writer never acknowledged a write: {child.stderr.read().decode()[-2000:]}")
    time.sleep(rng.uniform(0.0, 0.4))
    child.send_signal(signal.SIGKILL)
    child.wait()
    reader.join()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return acked


@pytest.mark.soak
def test_sigkill_never_loses_an_acknowledged_write(tmp_path: Path) -> None:
    rng = random.Random(2026)
    data = tmp_path / "data"
    acked: list[str] = []
    for run in range(KILLS):
        acked += _run_until_killed(data, run, rng)
        with Store(data) as store:
            for table in ("default", "g4"):
                assert store.verify(table) == [], f"after kill {run}"
            found: dict[str, bytes] = {}
            for table in ("default", "g4"):
                found |= store.get(table, acked)
            missing = sorted(set(acked) - set(found))
            assert not missing, f"after kill {run}: {len(missing)} acknowledged uids lost, e.g. {missing[:3]}"
            for uid, blob in found.items():
                assert [e.eid.uid for e in decode(blob)] == [uid]
            stats = store.stats("g4")
            assert stats["pending"] % 2 == 0, "a half-written push left an odd number of pending items"
    assert len(acked) > KILLS * 10
