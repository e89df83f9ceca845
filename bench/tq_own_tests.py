"""TransferQueue's own tests of its storage backend, run with expbuf's backend selected: the
tests its wheel installs (site-packages/tests, those upstream's CI runs once a backend:
e2e/test_kv_interface_e2e.py, e2e/test_e2e_lifecycle_consistency.py, e2e/test_checkpoint_e2e.py),
unchanged. Outside the project's suite: run once a TransferQueue release.

    python bench/tq_own_tests.py            # with expbuf's backend
    python bench/tq_own_tests.py --baseline # as shipped (SimpleStorage), for the count to compare

This file is also the pytest plugin that selects the backend (`-p tq_own_tests`): it starts one
`expbuf serve` on free ports, and wraps `transfer_queue.init` so that whatever config a test
passes has `backend.storage_backend` set to "Expbuf" and `backend.Expbuf` naming that server and
a fresh table (each first init starts empty, as SimpleStorage does); after each first init it
checks the storage manager really is expbuf's. Needs pytest-asyncio (TransferQueue's test
extra). Ray is given 8 logical CPUs (RAY_OVERRIDE_RESOURCES): TransferQueue asks one for its
controller and one for each SimpleStorage unit, more than a 2-core machine has.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

FILES = ("e2e/test_kv_interface_e2e.py", "e2e/test_e2e_lifecycle_consistency.py", "e2e/test_checkpoint_e2e.py")
_server: dict[str, Any] = {}


def _serve() -> tuple[subprocess.Popen, str]:
    data = tempfile.mkdtemp(prefix="expbuf-tq-tests-")
    log = Path(data + ".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"listening on \S+?:(\d+) ", log.read_text())
        if found:
            return proc, f"127.0.0.1:{found.group(1)}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"expbuf serve did not start: {log.read_text()[-2000:]}")


def pytest_configure(config: pytest.Config) -> None:
    import transfer_queue
    import transfer_queue.interface as interface
    from omegaconf import OmegaConf

    from expbuf.client.transferqueue.storage import ExpbufStorageManager

    proc, target = _serve()
    _server.update(proc=proc, target=target)
    tables = itertools.count()
    shipped = interface.init

    def init(conf: Any = None) -> Any:
        first = interface._TQ_CONTROLLER is None and interface._TQ_CLIENT is None
        expbuf = {"storage_backend": "Expbuf", "Expbuf": {"target": target, "table": f"tq_{next(tables)}"}}
        result = shipped(OmegaConf.merge(conf or {}, {"backend": expbuf}))
        if first and interface._TQ_CLIENT is not None:
            manager = interface._TQ_CLIENT.storage_manager
            assert isinstance(manager, ExpbufStorageManager), f"the backend is {type(manager).__name__}"
        return result

    interface.init = transfer_queue.init = init


def pytest_report_header(config: pytest.Config) -> str:
    return f"TransferQueue's backend: Expbuf, expbuf serve at {_server.get('target')}"


def pytest_unconfigure(config: pytest.Config) -> None:
    proc = _server.get("proc")
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="store_true", help="TransferQueue's tests as shipped (SimpleStorage)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments")
    args = parser.parse_args()
    import transfer_queue

    root = Path(transfer_queue.__file__).parent.parent / "tests"
    if not (root / FILES[0]).exists():
        raise SystemExit(f"no TransferQueue tests at {root}: this transferqueue wheel ships none")
    env = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 8})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    plugin = [] if args.baseline else ["-p", "tq_own_tests"]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(root), "-rfEs", "-q"]
    command += plugin + [str(root / name) for name in FILES] + args.pytest_args
    print("+", " ".join(command), flush=True)
    raise SystemExit(subprocess.run(command, env=env, cwd=root, check=False).returncode)


if __name__ == "__main__":
    main()
