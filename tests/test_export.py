"""Browsing a table (ListExperiences) and `expbuf export`, against a real server on loopback."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from test_ops import ServerProcess

from expbuf.client import BufferClient, BufferError, decode, trxp
from expbuf.server.store import Store
from expbuf.server.store.core.whole_table.pages import SCAN_PER_ITEM
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from helpers import group_items, make_experience, wait_ready
from test_quarantine import damage


def fill(client: BufferClient, table: str) -> None:
    """Groups of 2 at model versions 0..9, then one pending group (its second run never came); the
    complete ones ready, their advantages computed (the module's first push loads the child's torch)."""
    client.create_table(table, group_size=2, estimator="grpo")
    for task in range(10):
        runs = [make_experience(0, task, run, reward=float(run), version=task) for run in range(2)]
        client.push(runs, table=table)
    client.push([make_experience(0, 99, 0, version=5)], table=table)
    wait_ready(client, table, 20)


def everything(client: BufferClient, table: str, **filters: object) -> list:
    listed, after = [], 0
    while True:
        page = client.list_experiences(table, after=after, **filters)
        listed += page.experiences
        if page.done:
            return listed
        after = page.next


def test_pages_cover_the_live_experiences_once_in_insertion_order(child_server: ServerProcess) -> None:
    with BufferClient(child_server.target) as client:
        fill(client, "t0")
        next(client.sample("t0", num_groups=2, delivery="lease", lease_seconds=600, max_batches=1, timeout=10))
        listed, after, sizes = [], 0, []
        while True:
            page = client.list_experiences("t0", after=after, limit=3)
            sizes.append(len(page.experiences))
            listed += page.experiences
            if page.done:
                break
            after = page.next
        assert [e.uid for e in listed] == [e.uid for e in everything(client, "t0")]
        assert len(listed) == 21 and len({e.uid for e in listed}) == 21 and max(sizes) == 3
        assert [e.model_version for e in listed] == [v for v in range(10) for _ in range(2)] + [5]
        states = [e.state for e in listed]
        assert states.count("leased") == 4 and states[-1] == "pending"
        assert all(s == "ready" for s in states[4:-1])
        assert {e.group_id for e in listed[:2]} == {"0/0"} and listed[0].reward == 0.0 and listed[1].reward == 1.0


def test_filters_by_state_and_version(child_server: ServerProcess) -> None:
    with BufferClient(child_server.target) as client:
        fill(client, "t1")
        assert [e.uid for e in everything(client, "t1", states=["pending"])] == ["0/99/0/0/r0s0"]
        fresh = everything(client, "t1", min_model_version=7)
        assert sorted({e.model_version for e in fresh}) == [7, 8, 9] and len(fresh) == 6
        middle = everything(client, "t1", min_model_version=4, max_model_version=5, states=["ready"])
        assert sorted(e.model_version for e in middle) == [4, 4, 5, 5]
        # A filter that matches little reads a bounded stretch per call and says where to go on.
        first = client.list_experiences("t1", min_model_version=9, limit=1)
        assert first.experiences == [] and not first.done and first.next == SCAN_PER_ITEM  # sequences from 0
        with pytest.raises(BufferError) as refused:
            client.list_experiences("t1", states=["consumed"])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'consumed'" in refused.value.details
        with pytest.raises(BufferError) as refused:
            client.list_experiences("t1", limit=10_001)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "10000" in refused.value.details
        with pytest.raises(BufferError) as refused:
            client.list_experiences("nope")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND


def export(server: ServerProcess, table: str, *args: str) -> subprocess.CompletedProcess:
    return cli_forks.run("export", table, "--target", server.target, "--page", "4", *args)


def test_export_json_lines_with_the_servers_advantages(child_server: ServerProcess) -> None:
    with BufferClient(child_server.target) as client:
        fill(client, "t2")
        stored = {e.eid.uid: e for e in client.get([e.uid for e in everything(client, "t2")], table="t2")}
    done = export(child_server, "t2", "--state", "ready", "--min-version", "8")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(line["uid"] for line in lines) == sorted(u for u, e in stored.items() if e.model_version >= 8)
    assert done.stderr.strip() == "exported 4 experiences of t2"
    for line in lines:
        exp = stored[line["uid"]]
        assert line["state"] == "ready" and line["eid"]["task"] == exp.eid.task
        assert line["tokens"] == exp.tokens.tolist() and line["advantages"] == exp.advantages.tolist()
        assert line["info"] == {"model_version": exp.model_version} and line["reward"] == exp.reward
        assert abs(line["advantages"][0]) > 0.5  # the group's grpo values, not zeros


def test_export_json_lines_writes_bytes_and_non_finite_floats_of_the_metadata(child_server: ServerProcess) -> None:
    """TRXP's metadata may hold bytes (values and dict keys) and NaN: json.dumps raised on bytes,
    and one such experience ended the whole export with a traceback (a helper's audit)."""
    exp = make_experience(0, 0, 0, reward=1.0)
    exp.info = {"digest": b"\x00\xff", b"raw": [float("nan"), b"x"]}
    with BufferClient(child_server.target) as client:
        client.create_table("t6", group_size=1, estimator="none")
        client.push([exp], table="t6")
    done = export(child_server, "t6")
    assert done.returncode == 0, done.stderr
    (line,) = [json.loads(text) for text in done.stdout.splitlines()]
    assert line["info"] == {"digest": {"base64": "AP8="}, "base64:cmF3": ["nan", {"base64": "eA=="}]}


def test_export_json_lines_writes_a_lone_surrogate_and_an_int_of_any_size(child_server: ServerProcess) -> None:
    """A str of TRXP's metadata may hold a lone surrogate, and an int may be of any size: the first
    ended the export (UnicodeEncodeError; or wrote a byte that is not UTF-8 where stdout was a
    pipe), the second too (str() of an int of more than 4,300 digits). Such a line is written
    with its surrogate escaped, as JSON writes one, and such an int as {"hex": its hex}."""
    exp = make_experience(0, 0, 0, reward=1.0)
    exp.info = {"text": "a\ud800b", "key\udcff": 1, "big": 2**60_000, "small": -(2**70)}
    with BufferClient(child_server.target) as client:
        client.create_table("t7", group_size=1, estimator="none")
        client.push([exp], table="t7")
    done = export(child_server, "t7")
    assert done.returncode == 0, done.stderr
    (text,) = done.stdout.splitlines()
    line = json.loads(text)
    assert line["info"] == {"text": "a\ud800b", "key\udcff": 1, "big": {"hex": hex(2**60_000)}, "small": -(2**70)}
    assert "\\ud800" in text  # escaped


def test_export_trxp_reads_back_as_stored(child_server: ServerProcess, tmp_path: Path) -> None:
    with BufferClient(child_server.target) as client:
        fill(client, "t3")
        want = client.get([e.uid for e in everything(client, "t3")], table="t3")
    out = tmp_path / "t.trxp"
    done = export(child_server, "t3", "--format", "trxp", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == trxp.encode(want)
    assert [e.eid.uid for e in decode(out.read_bytes())] == [e.eid.uid for e in want]
    refused = export(child_server, "t3", "--format", "trxp")
    assert refused.returncode == 2 and "--out" in refused.stderr


def test_export_mistakes_are_one_line(child_server: ServerProcess, tmp_path: Path) -> None:
    """A file that cannot be written, or a page size below 0: exit code 2, one line naming it, no
    traceback."""
    with BufferClient(child_server.target) as client:
        fill(client, "t5")
    nowhere = tmp_path / "no-such-dir" / "t"
    huge = "99999999999999999999"  # a ValueError's traceback from the request's message
    for args, said in (
        (("--out", str(nowhere)), str(nowhere)),
        (("--format", "trxp", "--out", str(nowhere)), str(nowhere)),
        (("--page", "-1"), "--page -1"),
        (("--out", ""), "--out : no file named"),  # it wrote to standard output
        (("--page", huge), f"--page {huge}"),
        (("--min-version", huge), f"--min-version {huge}: past a model version's range"),
        (("--max-version", f"-{huge}"), f"--max-version -{huge}: past a model version's range"),
    ):
        done = cli_forks.run("export", "t5", "--target", child_server.target, *args)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert said in lines[0] and not done.stdout
    done = cli_forks.run("export", "t5\udcff", "--target", child_server.target)  # a byte not UTF-8 on the command line
    assert done.returncode == 2 and "not a table's name (not UTF-8 text)" in done.stderr, done.stderr
    # A TRXP export the server refuses (no such table) leaves no file: it is written at the end.
    out = tmp_path / "refused.trxp"
    done = cli_forks.run("export", "absent", "--target", child_server.target, "--format", "trxp", "--out", str(out))
    assert done.returncode == 1 and "NOT_FOUND" in done.stderr and not out.exists(), done.stderr


@pytest.mark.parametrize("form", ["trxp", "jsonl"])
def test_an_export_that_fails_leaves_the_file_it_would_replace_as_it_was(
    child_server: ServerProcess, tmp_path: Path, form: str
) -> None:
    """`expbuf export NOPE --out backup.trxp` deleted an earlier backup.trxp, and a JSON-lines
    export emptied its file, whatever failed: no such table, a page past the server's bound, no
    server (a helper's audit). An export is written beside its file and put in its place once whole;
    a --target without a port is one line, exit code 2."""
    table = f"kept_{form}"
    with BufferClient(child_server.target) as client:
        client.create_table(table, estimator="none")
        client.push([make_experience(0, 0, 0)], table=table)
    out = tmp_path / f"backup.{form}"
    out.write_bytes(b"an earlier export")
    for args, code in (
        (("absent",), 1),
        ((table, "--page", "10001"), 1),
        ((table, "--target", "127.0.0.1:1"), 1),
        ((table, "--target", "localhost"), 2),
    ):
        target = () if "--target" in args else ("--target", child_server.target)
        done = cli_forks.run("export", *args, *target, "--format", form, "--out", str(out))
        assert done.returncode == code and "Traceback" not in done.stderr, (args, done.stderr)
        assert out.read_bytes() == b"an earlier export", args
    assert sorted(path.name for path in tmp_path.iterdir()) == [out.name]  # nothing left beside it


def test_an_export_whose_reader_leaves_ends_without_a_traceback(child_server: ServerProcess) -> None:
    """`expbuf export t | head -1`: the reader leaves after its first line, the export's next write
    finds the pipe closed, and it ends (exit code 1) with nothing on stderr, not BrokenPipeError's
    traceback."""
    with BufferClient(child_server.target) as client:
        client.create_table("wide", estimator="none", group_by="none")
        client.push([make_experience(0, task, 0, response=4000) for task in range(12)], table="wide")  # ~25 KB a line
    export = subprocess.Popen(
        [sys.executable, "-m", "expbuf.server.cli", "export", "wide", "--target", child_server.target, "--page", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert export.stdout is not None and export.stderr is not None
    assert json.loads(export.stdout.readline())["eid"]
    export.stdout.close()  # as head does, past the pipe's 64 KiB
    assert export.wait(60) == 1
    assert export.stderr.read() == b""


def test_export_goes_past_a_damaged_experience(tmp_path: Path) -> None:
    """A payload damaged on disk (no scrub, so the export's Get is the first read to meet it):
    the export leaves it out, says so, writes every other experience, and the experience is
    quarantined."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        for task in range(6):
            store.put("t", group_items(0, task, 2))
        damage(store, "t", "0/3/1/0/r1s0")
    proc = ServerProcess(str(data), "--scrub-mb-per-second", "0")
    try:
        done = export(proc, "t")
        assert done.returncode == 0, done.stderr
        assert sorted(json.loads(line)["uid"] for line in done.stdout.splitlines()) == sorted(
            f"0/{task}/{run}/0/r{run}s0" for task in range(6) for run in range(2) if (task, run) != (3, 1)
        )
        assert done.stderr.strip() == (
            "exported 11 experiences of t (1 listed but not returned: retired meanwhile, or quarantined as damaged)"
        )
        with BufferClient(proc.target) as client:
            stats = client.stats("t")["t"]
            assert (stats.quarantined, stats.groups_failed, stats.ready) == (1, 1, 10)
    finally:
        assert proc.stop(signal.SIGTERM) == 0


def test_an_export_goes_through_a_link_into_a_pipe_and_keeps_its_file_s_mode(
    child_server: ServerProcess, tmp_path: Path
) -> None:
    """--out wrote a file beside its path and renamed it over it: a symbolic link (/dev/stdout
    among them) was replaced by a file of its own, a named pipe's reader got nothing, and the file
    was made 0600 whatever it was before. The link stays and its file takes the export, a pipe
    (or a device) is written in place, a file keeps its mode and a new one takes the umask's."""
    table = "through"
    with BufferClient(child_server.target) as client:
        client.create_table(table, estimator="none")
        client.push([make_experience(0, 0, 0)], table=table)
    target = ("--target", child_server.target)
    kept, link = tmp_path / "kept.jsonl", tmp_path / "link.jsonl"
    kept.write_text("an earlier export")
    kept.chmod(0o644)
    link.symlink_to(kept.name)
    assert cli_forks.run("export", table, *target, "--out", str(link)).returncode == 0
    assert link.is_symlink() and json.loads(kept.read_text())["uid"] == "0/0/0/0/r0s0"
    assert kept.stat().st_mode & 0o777 == 0o644
    fresh = tmp_path / "fresh.jsonl"
    assert cli_forks.run("export", table, *target, "--out", str(fresh)).returncode == 0
    mask = os.umask(0o022)
    os.umask(mask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~mask
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(pipe.read_bytes()))
    reader.start()
    done = cli_forks.run("export", table, *target, "--out", str(pipe))
    reader.join(30)
    assert done.returncode == 0 and stat.S_ISFIFO(pipe.lstat().st_mode), done.stderr
    assert [json.loads(line)["uid"] for line in read[0].decode().splitlines()] == ["0/0/0/0/r0s0"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fresh.jsonl", "kept.jsonl", "link.jsonl", "pipe"]
