"""Compact advantages: a sample reply that sends one value per experience beside the payload.

The client rebuilds `advantages` and `returns` from the values; they must be the tensors the
server sends in full to a request that does not ask (an older client), bit for bit.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from expbuf.client import BufferClient, trxp
from expbuf.client.trxp import TrxpError
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import make_experience

GROUPS, SIZE = 3, 4
# Tables of one estimator each: (name, estimator, its parameters, whether its advantages are token-level).
TABLES = [
    ("grpo", "grpo", {}, False),
    ("grpo_batch_std", "grpo", {"std_cal_level": "batch"}, False),
    ("rloo", "rloo", {}, False),
    ("opmd", "opmd", {"tau": 0.5, "opmd_baseline": "logavgexp"}, False),
    ("whitened", "reinforce++_baseline", {}, False),
    ("token_level", "reinforceplusplus", {"gamma": 0.9}, True),
]


def experiences() -> list:
    """Groups whose members differ in reward, response length and action mask: a BOOL mask
    with zeros, one without, an int32 mask, none at all, and one pushed with advantages of
    its own (which the table's estimator replaces)."""
    out = []
    for task in range(GROUPS):
        for run in range(SIZE):
            exp = make_experience(1, task, run, reward=float((task + 1) * run) / 7 - 0.3, response=5 + 3 * run)
            kind = (task * SIZE + run) % 5
            if kind == 0:
                exp.action_mask = torch.arange(exp.action_mask.numel()) % 3 != 1
            elif kind == 2:
                exp.action_mask = (torch.arange(exp.action_mask.numel()) % 2).to(torch.int32)
            elif kind == 3:
                exp.action_mask = None
            elif kind == 4:
                exp.advantages = torch.full((exp.action_mask.numel(),), 9.0)
                exp.returns = torch.full((exp.action_mask.numel(),), 9.0)
            out.append(exp)
    return out


@pytest.fixture(scope="module")
def server(start_module_server: Servers) -> ExpbufServer:
    server = start_module_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        payload = trxp.encode(experiences())
        for table, estimator, params, _ in TABLES:
            client.create_table(table, estimator=estimator, estimator_params=params, group_size=SIZE)
            client.push(payload, table=table)
        for table, *_ in TABLES:
            wait_computed(client, table)
    return server


def wait_computed(client: BufferClient, table: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = client.stats(table)[table]
        if stats.groups_computing == 0 and stats.ready == GROUPS * SIZE:
            return
        time.sleep(0.02)
    raise AssertionError(f"advantages of table {table} not computed: {client.stats(table)[table]}")


def replay(server: ExpbufServer, table: str, **fields: object) -> pb.SampleReply:
    """One batch of every group, left in the table: each request form sees the same batch."""
    request = pb.SampleRequest(
        table=table, num_groups=GROUPS, delivery=pb.DELIVERY_REPLAY, wait_seconds=5, max_batches=1, **fields
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        (reply,) = pb_grpc.ExperienceBufferStub(channel).Sample(iter([request]), timeout=20)
    return reply


def tensors(payload: bytes) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each experience's advantages and returns, by uid."""
    return {e.eid.uid: (e.advantages, e.returns) for e in trxp.decode(payload)}


def assert_bit_identical(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert got is not None and want is not None
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize(("table", "token_level"), [(t[0], t[3]) for t in TABLES])
def test_rebuilt_advantages_are_the_servers_bit_for_bit(server: ExpbufServer, table: str, token_level: bool) -> None:
    full = replay(server, table)
    compact = replay(server, table, compact_advantages=True)
    assert list(full.uids) == list(compact.uids) and len(full.uids) == GROUPS * SIZE
    assert not full.advantages and not full.response_lengths  # an old request: the payload is whole
    want = tensors(full.payload)
    assert not any(torch.equal(a, torch.full_like(a, 9.0)) for a, _ in want.values())  # pushed ones replaced
    if token_level:  # only the payload can carry them: sent in full whatever the request
        assert not compact.advantages and compact.payload == full.payload
        return
    assert len(compact.advantages) == len(compact.response_lengths) == len(compact.uids)
    assert all(a is None and r is None for a, r in tensors(compact.payload).values())  # none in the payload
    assert len(compact.payload) < len(full.payload)
    rebuilt = tensors(trxp.attach_advantages(compact.payload, compact.advantages, compact.response_lengths))
    assert rebuilt.keys() == want.keys()
    for uid, (advantages, returns) in rebuilt.items():
        assert_bit_identical(advantages, want[uid][0])
        assert_bit_identical(returns, want[uid][1])
    assert any(a.abs().max() > 0.1 for a, _ in rebuilt.values())
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:  # the client asks, and rebuilds
        batch = next(client.sample(table, num_groups=GROUPS, delivery="replay", max_batches=1, timeout=5))
    assert len(batch.uids) == GROUPS * SIZE
    for exp in batch.experiences:
        assert_bit_identical(exp.advantages, want[exp.eid.uid][0])
        assert_bit_identical(exp.returns, want[exp.eid.uid][1])
    assert tensors(batch.payload).keys() == want.keys()  # batch.payload is a whole TRXP batch, as documented


def test_a_table_without_an_estimator_sends_nothing_beside(server: ExpbufServer) -> None:
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("plain", estimator="none", group_size=SIZE)
        client.push(trxp.encode(experiences()), table="plain")
    reply = replay(server, "plain", compact_advantages=True)
    assert not reply.advantages and not reply.response_lengths
    pushed = {e.eid.uid: e.advantages for e in experiences()}
    for uid, (advantages, _) in tensors(reply.payload).items():  # what was pushed, untouched
        assert (advantages is None) == (pushed[uid] is None)
        assert advantages is None or torch.equal(advantages, pushed[uid])
    assert any(a is not None for a in pushed.values())


def test_values_that_do_not_match_the_batch_are_refused(server: ExpbufServer) -> None:
    compact = replay(server, "grpo", compact_advantages=True)
    values, lengths = list(compact.advantages), list(compact.response_lengths)
    with pytest.raises(TrxpError, match=f"{len(values) - 1} values for a batch of {len(values)} experiences"):
        trxp.attach_advantages(compact.payload, values[1:], lengths[1:])
    with pytest.raises(TrxpError, match=f"{len(values)} values but {len(values) - 1} response lengths"):
        trxp.attach_advantages(compact.payload, values, lengths[1:])
    full = replay(server, "grpo")
    with pytest.raises(TrxpError, match="item 0 already carries advantages"):
        trxp.attach_advantages(full.payload, values, lengths)


def test_trinitys_own_reader_sees_the_rebuilt_batch_as_the_full_one(server: ExpbufServer) -> None:
    """batch.payload after the rebuild, read by Trinity-RFT's Experience.deserialize_many."""
    trinity = pytest.importorskip("trinity.common.experience")
    full = {e.eid.uid: e for e in trinity.Experience.deserialize_many(replay(server, "grpo_batch_std").payload)}
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        batch = next(client.sample("grpo_batch_std", num_groups=GROUPS, delivery="replay", max_batches=1, timeout=5))
    rebuilt = trinity.Experience.deserialize_many(batch.payload)
    assert len(rebuilt) == len(full) == GROUPS * SIZE
    for exp in rebuilt:
        want = full[exp.eid.uid]
        assert_bit_identical(exp.advantages, want.advantages)
        assert_bit_identical(exp.returns, want.returns)
        assert torch.equal(exp.tokens, want.tokens)
