"""A push in chunks whose large items are staged as it arrives (server/rpc/ingest.Stager): stored
as the same experiences as a push read whole, mixed with small items; a refused one (another
content under a stored uid, a table that does not exist) and a duplicate leave nothing staged;
the server holds a push's staging, not the push, against max_inflight_bytes."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from expbuf.client import AlreadyExistsError, BufferClient, NotFoundError
from expbuf.client.schema.reasons import Reason
from expbuf.server.store.disk.environment import Environment

from helpers import ServerProcess, make_experience, servers

RESPONSE = 2_000_000  # about 18 MB an experience: five chunks of the store
CHUNK = 1 << 20  # the client's chunks, smaller than the store's


def counts(data: Path) -> dict[str, int]:
    """Entries of the chunk databases and payloads of a stopped server's directory."""
    env = Environment(data, readonly=True)
    try:
        with env.read() as txn:
            return {name: txn.stat(env.db[name])["entries"] for name in ("chunks", "staged", "blobs")}
    finally:
        env.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    with servers() as start:
        # a cap smaller than one push: a push whose items are staged holds a piece of each
        yield start(str(tmp_path / "data"), env={"EXPBUF_MAX_INFLIGHT_BYTES": str(20 << 20)})


def stopped(server: ServerProcess) -> None:
    assert server.stop(signal.SIGTERM) == 0, "".join(server.log)


def test_large_and_small_items_in_one_push_are_stored_as_a_push_read_whole(
    server: ServerProcess, tmp_path: Path
) -> None:
    group = [
        make_experience("s", 0, 0, response=RESPONSE),
        make_experience("s", 0, 1, response=7),
        make_experience("s", 0, 2, response=RESPONSE // 3),
    ]
    with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table("t", group_size=3)
        assert len(client.push(group, table="t").stored) == 3
        got = {one.eid.uid: one for one in client.get([one.eid.uid for one in group], table="t")}
        (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=30, delivery="consume")
    for pushed in group:
        assert torch.equal(got[pushed.eid.uid].tokens, pushed.tokens)
    assert [one.eid.uid for one in batch.experiences] == [one.eid.uid for one in group]
    for pushed, sampled in zip(group, batch.experiences, strict=True):
        assert torch.equal(sampled.logprobs, pushed.logprobs) and torch.equal(sampled.action_mask, pushed.action_mask)
    stopped(server)
    assert counts(tmp_path / "data") == {"chunks": 0, "staged": 0, "blobs": 0}  # consumed, chunks and all


def test_a_refused_or_duplicate_push_leaves_nothing_staged(server: ServerProcess, tmp_path: Path) -> None:
    first = make_experience("s", 0, 0, response=RESPONSE)
    other = make_experience("s", 0, 0, response=RESPONSE)
    other.logprobs = torch.full((RESPONSE,), -1.5)  # another content under the same uid
    with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table("t", group_size=1)
        assert client.push([first], table="t").stored
        assert client.push([first], table="t").duplicates == [first.eid.uid]
        with pytest.raises(AlreadyExistsError) as conflict:
            client.push([other], table="t")
        assert conflict.value.reason == Reason.CONFLICT
        with pytest.raises(NotFoundError) as missing:
            client.push([other], table="absent")
        assert missing.value.reason == Reason.NOT_FOUND and "absent" in str(missing.value)
        (stored,) = client.get([first.eid.uid], table="t")
        assert torch.equal(stored.logprobs, first.logprobs)
    stopped(server)
    found = counts(tmp_path / "data")
    assert found["staged"] == 0 and found["blobs"] == 1 and found["chunks"] == 5  # the first push's alone
