"""A server killed (SIGKILL) between two pieces of a partial rollout, and again while the last
piece is on its way: every piece acknowledged is there after each restart, the piece cut short is
not (nothing half-appended), no sample serves the rollout before its last piece, and the last
piece sent again finishes it into the experience pushed whole; `expbuf check` finds the directory
clean."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from expbuf.client import EID, BufferClient, Experience, trxp
from expbuf.client.errors import DeadlineExceededError
from expbuf.client.rollout_pieces import split

from faultkit import channel, check_data, cut_push, stub
from helpers import servers

pytestmark = pytest.mark.faults

CHUNK = 1 << 20
PROMPT, RESPONSE = 64, 1 << 21  # the last piece: about 24 MiB, sent in chunks of 1 MiB
SENT_BEFORE_THE_KILL = 8


def rollout() -> Experience:
    length = PROMPT + RESPONSE
    generator = torch.Generator().manual_seed(5)
    return Experience(
        eid=EID(batch=0, task=0, run=0, suffix="r"),
        tokens=torch.randint(0, 150_000, (length,), dtype=torch.int32, generator=generator),
        prompt_length=PROMPT,
        logprobs=-torch.rand(RESPONSE, generator=generator),
        action_mask=torch.ones(RESPONSE, dtype=torch.bool),
        routed_experts=torch.randint(0, 128, (length, 4), dtype=torch.uint8, generator=generator),
        reward=1.0,
        info={"version_segments": [[7, 0], [8, RESPONSE // 2], [9, RESPONSE - 10]]},
    )


def held_tokens(client: BufferClient) -> int:
    """The tokens of the rollout held in pieces (0: none), after checking that nothing is served."""
    with pytest.raises(DeadlineExceededError):
        next(client.sample("t", num_groups=1, max_batches=1, timeout=0.5, delivery="replay"))
    found = client.get_partials(["0/0"], table="t")
    return found[0].tokens.numel() if found else 0


def test_a_server_killed_between_pieces_keeps_the_acknowledged_ones_and_serves_no_half(tmp_path: Path) -> None:
    data = tmp_path / "data"
    whole = rollout()
    first, second, last = split(whole, [RESPONSE // 4, RESPONSE // 2])
    payload = trxp.build([trxp.from_experience(last)])
    asked, hold = threading.Event(), threading.Event()

    with servers() as start:
        server = start(str(data))
        with BufferClient(server.target, timeout=120) as client:
            client.create_table("t", group_size=1)
            assert client.push([first], table="t").partial == [first.eid.uid]
        server.proc.kill()  # between the first piece and the second
        server.proc.wait(30)
        server = start(str(data))
        with BufferClient(server.target, timeout=120) as client:
            assert held_tokens(client) == PROMPT + RESPONSE // 4
            assert client.push([second], table="t").partial == [second.eid.uid]
        with channel(server.target) as chan:
            replies = stub(chan).PushStream(cut_push(payload, "t", CHUNK, SENT_BEFORE_THE_KILL, asked, hold))
            try:
                assert asked.wait(120), "the server did not read the last piece"
                server.proc.kill()  # the last piece on its way, never acknowledged
                server.proc.wait(30)
            finally:
                hold.set()
                replies.cancel()
        server = start(str(data))
        with BufferClient(server.target, timeout=120, push_chunk_bytes=CHUNK) as client:
            assert held_tokens(client) == PROMPT + RESPONSE // 2  # the two pieces, not a byte of the third
            done = client.push([last], table="t")
            assert (done.stored, done.completed_groups) == ([whole.eid.uid], ["0/0"])
            assert client.get_partials(["0/0"], table="t") == []
            (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=30, delivery="consume")
        server.proc.terminate()
        assert server.proc.wait(30) == 0, "".join(server.log)
    (got,) = batch.experiences
    for name in ("tokens", "logprobs", "action_mask", "routed_experts"):
        assert torch.equal(getattr(got, name), getattr(whole, name)), name
    assert got.info == whole.info and got.prompt_length == PROMPT
    checked = check_data(data)
    assert checked.returncode == 0, checked.stdout + checked.stderr
