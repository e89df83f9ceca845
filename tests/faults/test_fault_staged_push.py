"""A server killed (SIGKILL) while a push in chunks is staging its large items: the chunks it
staged were durable, but the push was never acknowledged, so nothing of it may be served and
its staging must not stay on disk. The next start drops it; the same push, sent again, is
stored and served whole, and `expbuf check` finds the directory clean."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from expbuf.client import BufferClient, trxp
from expbuf.server.store.disk.chunk_heads import CHUNK_BYTES
from expbuf.server.store.disk.environment import Environment

from faultkit import channel, check_data, cut_push, stub
from helpers import make_experience, servers

pytestmark = pytest.mark.faults

CHUNK = 1 << 20
SENT_BEFORE_THE_KILL = 48  # chunks of 1 MiB: far past what gRPC's windows hold unread
STAGED_BEFORE_THE_KILL = 4  # of the store's chunks, durable (the table's staged_bytes says so) before the kill


def counts(data: Path) -> dict[str, int]:
    """The entries of the databases a staged push and its experience write; "tombs" counts a
    records table's tombstones or a rows table's (its groups' directory entries)."""
    env = Environment(data, readonly=True)
    try:
        with env.read() as txn:
            found = {
                name: txn.stat(env.db[name])["entries"] for name in ("chunks", "staged", "blobs", "items", "tombs")
            }
            if "gdir" in env.db:
                found["tombs"] += txn.stat(env.db["gdir"])["entries"]
            return found
    finally:
        env.close()


def test_a_server_killed_while_a_push_stages_keeps_nothing_of_it_and_takes_it_again(tmp_path: Path) -> None:
    data = tmp_path / "data"
    pushed = make_experience("s", 0, 0, response=(96 * CHUNK) // 9)
    payload = trxp.build([trxp.from_experience(pushed)])
    asked, hold = threading.Event(), threading.Event()

    with servers() as start:
        server = start(str(data))
        with BufferClient(server.target) as client, channel(server.target) as chan:
            client.create_table("t", group_size=1)
            replies = stub(chan).PushStream(cut_push(payload, "t", CHUNK, SENT_BEFORE_THE_KILL, asked, hold))
            try:
                assert asked.wait(120), "the server did not read the push"
                deadline = time.monotonic() + 120  # the server's writer stages in its own time
                while client.stats("t")["t"].staged_bytes < STAGED_BEFORE_THE_KILL * CHUNK_BYTES:
                    assert time.monotonic() < deadline, f"staged {client.stats('t')['t'].staged_bytes} bytes"
                    time.sleep(0.05)
                server.proc.kill()
                server.proc.wait(30)
            finally:
                hold.set()
                replies.cancel()
    found = counts(data)
    assert found["staged"] == 1 and found["chunks"] >= STAGED_BEFORE_THE_KILL, found  # durable, never acknowledged
    assert found["blobs"] == found["items"] == found["tombs"] == 0
    with servers() as start:
        server = start(str(data))
        assert "dropped the sections of 1 push(es) in chunks that a stop cut short" in "".join(server.log)
        with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
            assert client.stats("t").tables["t"].pushed == 0
            assert client.push([pushed], table="t").stored == [pushed.eid.uid]
            (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=30, fields=["tokens", "logprobs"])
            batch.ack()
        server.proc.terminate()
        assert server.proc.wait(30) == 0, "".join(server.log)
    assert torch.equal(batch.columns["tokens"].values, pushed.tokens)
    assert torch.equal(batch.columns["logprobs"].values, pushed.logprobs)
    assert counts(data) == {"chunks": 0, "staged": 0, "blobs": 0, "items": 0, "tombs": 1}  # a tombstone alone
    checked = check_data(data)
    assert checked.returncode == 0, checked.stdout + checked.stderr
