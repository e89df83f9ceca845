"""A damaged payload met by a Sample stream after batches were sent ahead of it: those batches,
which the client may have handed to its trainer, are settled (confirmed, delivered) before the
stream ends with DATA_LOSS, never given back to be trained twice."""

from __future__ import annotations

import time

import grpc
import lmdb
import pytest
import torch

from expbuf.client import EID, BufferClient, Experience
from expbuf.client.errors import DataLossError
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from helpers import Conversation

TOKENS = 1_500_000  # 6 MB of int32 tokens that do not compress: two chunks, in zstd frames or not


def big(task: int, run: int) -> Experience:
    made = torch.Generator().manual_seed(task * 100 + run)
    tokens = torch.randint(0, 2**31 - 1, (TOKENS,), dtype=torch.int32, generator=made)
    return Experience(eid=EID(batch=0, task=task, run=run), tokens=tokens, prompt_length=8, reward=float(run))


def damage_last_chunk(server: ExpbufServer) -> None:
    """Flip a byte of the last chunk stored: the second run's second, of the group pushed last."""
    store = server.store
    db = store.db["chunks"]
    with store.environment.read() as txn, txn.cursor(db=db) as cursor:
        victim = max(key for key, _ in cursor if not key.endswith(b"\xff" * 4))  # a chunk, not its set's head

    def damage(txn: lmdb.Transaction) -> None:
        value = bytearray(txn.get(victim, db=db) or b"")
        value[len(value) // 2] ^= 0xFF
        txn.put(victim, bytes(value), db=db)

    store.environment.submit(damage)


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_batch_handed_before_a_damaged_one_is_delivered_not_served_again(
    server: ExpbufServer, compression: str
) -> None:
    """A zstd reply meets the damage after the damaged batch's first message went (a chunk is
    decompressed as it is sent): the stream ended without settling the batch before it, which went
    back to the buffer although the client had handed it over; its ack failed NOT_FOUND and the
    next stream served it again."""
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=60) as client:
        client.create_table("big", group_size=2, estimator="none", compression=compression)
        for task in range(2):
            client.push([big(task, run) for run in range(2)], table="big")
        damage_last_chunk(server)
        handed = []
        with pytest.raises(DataLossError, match="does not match its digest"):
            for batch in client.sample("big", num_groups=1, delivery="lease", timeout=5, max_batches=2):
                handed.append(batch.groups)
                batch.ack()  # NOT_FOUND where the stream gave it back
        assert handed == [["0/0"]]
        again = [b.groups for b in client.sample("big", num_groups=1, timeout=1, allow_partial=True, max_batches=2)]
        stats = client.stats("big")["big"]
    assert again == []  # the damaged group failed whole; the one handed over is not served again
    assert (stats.consumed, stats.damaged, stats.ready) == (2, 1, 0)


def test_a_client_that_confirms_a_batch_as_it_hands_it_over_gets_it_delivered(server: ExpbufServer) -> None:
    """As a client that confirms a batch when its trainer takes it, a moment after the batch came
    whole (the batch after it, damaged, already on its way): the stream waits for that confirmation
    before it ends DATA_LOSS, and the batch is delivered (leased), not back in the buffer."""
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=60) as client:
        client.create_table("big", group_size=2, estimator="none", compression="zstd")
        for task in range(2):
            client.push([big(task, run) for run in range(2)], table="big")
        damage_last_chunk(server)
        with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
            first = pb.SampleRequest(
                table="big", num_groups=1, delivery=pb.DELIVERY_LEASE, wait_seconds=5, max_batches=2, window=2,
                lease_seconds=60, max_reply_bytes=64 << 20,
            )  # fmt: skip
            stream = Conversation(pb_grpc.ExperienceBufferStub(channel), first)
            whole, got = 0, 0
            while not whole or got < whole:  # the first batch's parts, until they add up to it
                reply = stream.read()
                whole = reply.whole_bytes or whole
                got += len(reply.part)
            time.sleep(1.0)  # its trainer takes it: the server meanwhile meets the damaged batch
            stream.confirm(1)
            assert stream.end().code() == grpc.StatusCode.DATA_LOSS
        stats = client.stats("big")["big"]
    assert (stats.leased, stats.ready, stats.damaged) == (2, 0, 1)  # the first batch's group: held by its lease
