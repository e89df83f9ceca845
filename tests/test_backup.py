"""`expbuf backup`: a copy of a data directory as it stood at one moment, made while its server
writes it (a copy of its files then is not one moment of it: `expbuf check` found each such copy
damaged), checked once made, and served by a server started on it with every experience that was
acknowledged before the copy began."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import lmdb

from expbuf.client import BufferClient

import cli_forks
from helpers import make_experience, servers, wait_for

COPIES = 3  # each while four pushers write


def backup(*args: str) -> subprocess.CompletedProcess:
    return cli_forks.run("backup", *args, timeout=120)


def test_a_backup_made_while_pushers_write_is_one_moment_and_serves_what_was_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    stop, failures = threading.Event(), []
    with servers() as start:
        server = start(str(data))
        with BufferClient(server.target, timeout=60) as admin:
            admin.create_table("t", group_size=4)
            acknowledged = [make_experience(0, task, run, response=2048) for task in range(16) for run in range(4)]
            admin.push(acknowledged, table="t")

        def push(worker: int) -> None:
            try:
                with BufferClient(server.target, timeout=60) as client:
                    task = 0
                    while not stop.is_set():
                        client.push([make_experience(worker + 1, task, run, response=2048) for run in range(4)], "t")
                        task += 1
            except Exception as exc:  # the test's failure, named
                failures.append(exc)

        pushers = [threading.Thread(target=push, args=(worker,)) for worker in range(4)]
        for thread in pushers:
            thread.start()
        try:
            with BufferClient(server.target, timeout=60) as admin:  # the pushers' pages among the copy's
                wait_for(lambda: admin.stats("t")["t"].ready >= 4 * len(acknowledged), "the pushers pushed nothing")
            copies = [tmp_path / f"copy{number}" for number in range(COPIES)]
            made = [backup("--data", str(data), str(copy)) for copy in copies]
        finally:
            stop.set()
            for thread in pushers:
                thread.join(60)
        assert not failures, failures
        for done in made:
            assert done.returncode == 0, done.stdout + done.stderr
            assert "copied" in done.stdout and "t: ok" in done.stdout, done.stdout
        refused = backup("--data", str(data), str(copies[0]))  # not empty now
        assert refused.returncode == 2 and "is not empty" in refused.stderr, refused.stderr
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
        restored = start(str(copies[-1]))
        with BufferClient(restored.target, timeout=60) as client:
            uids = [one.eid.uid for one in acknowledged]
            assert [one.eid.uid for one in client.get(uids, table="t")] == uids
            assert client.stats("t")["t"].ready >= len(acknowledged)
        assert restored.stop(signal.SIGTERM) == 0, "".join(restored.log)
    stopped = backup("--data", str(data), str(tmp_path / "of-a-stopped-server"), "--no-check")
    assert stopped.returncode == 0 and "copied" in stopped.stdout, stopped.stderr
    assert backup("--data", str(tmp_path / "nothing"), str(tmp_path / "x")).returncode == 2


def test_a_backup_cut_short_leaves_no_reader_behind_and_no_copy(tmp_path: Path) -> None:
    """A backup killed mid-copy (an OOM kill, a dropped `kubectl exec`) left its reader slot in the
    server's lock file: no page freed after it was reused, and the data file grew by all the server
    wrote until it restarted (a helper's audit: 32 MiB pushed and deleted, 32 MiB more file). The
    server frees the slots of readers that ended at each upkeep pass. A copy that fails leaves
    nothing in its target, and a file as the target is refused in one line."""
    data = tmp_path / "data"
    with servers() as start:
        server = start(str(data))
        with BufferClient(server.target, timeout=60) as client:
            client.create_table("t", group_size=1)
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(data)], stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
        )
        assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
        assert str(reader.pid) in readers(data)
        reader.kill()
        reader.wait(30)
        wait_for(lambda: str(reader.pid) not in readers(data), "the server to free the ended reader's slot", 30)
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    target = tmp_path / "a-file"
    target.write_text("")
    refused = backup("--data", str(data), str(target))
    assert refused.returncode == 2 and "is a file" in refused.stderr and "Traceback" not in refused.stderr
    (data / "data.mdb").write_bytes((data / "data.mdb").read_bytes()[:8192])  # damaged: its pages cut off
    failed = backup("--data", str(data), str(tmp_path / "never"))
    assert failed.returncode == 2 and not (tmp_path / "never").exists(), failed.stderr


# A reader of a data directory another process writes, as a backup's copy is: its read transaction
# registered in LMDB's lock file, held until the process is killed.
READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=64)
txn = env.begin()
print("reading", flush=True)
time.sleep(600)
"""


def readers(data: Path) -> str:
    """LMDB's table of the directory's readers, as mdb_reader_list prints it."""
    env = lmdb.open(str(data), readonly=True, lock=True, max_dbs=64)
    try:
        return env.readers()
    finally:
        env.close()
