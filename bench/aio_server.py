"""expbuf's Push, Sample and Ack on grpc.aio, to compare with the thread-pool server.

Only what the service benchmark drives is here; the store calls run in worker
threads so that the event loop keeps serving while a commit waits for fsync.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc.aio

from expbuf.client import trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import channel_options
from expbuf.server.rpc.service import sample_spec
from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import TableConfig

# The service benchmark measures transport and storage: no advantage computation.
TABLE = TableConfig.of(name="bench", estimator="none")


class AioService(pb_grpc.ExperienceBufferServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushReply:
        items = await asyncio.to_thread(trxp.parse, request.payload)
        result = await asyncio.to_thread(self.store.put, request.table or TABLE.name, items, timeout=30)
        return pb.PushReply(seq=request.seq, stored_uids=result.stored, duplicate_uids=result.duplicates)

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckReply:
        return pb.AckReply(acked=await asyncio.to_thread(self.store.ack, request.lease_id))

    async def Sample(self, requests: AsyncIterator[pb.SampleRequest], context: grpc.aio.ServicerContext):
        """The thread-pool server's conversation, without its reader thread: a batch per
        request, a consumed batch held until the client confirms it."""
        spec = sample_spec(await anext(requests))
        hold = spec.delivery == "consume"
        sent = 0
        while spec.max_batches == 0 or sent < spec.max_batches:
            batch = await asyncio.to_thread(self.store.sample, spec, hold=hold)
            payload = await asyncio.to_thread(lambda b=batch: b.payload)
            yield pb.SampleReply(payload=payload, uids=batch.uids, group_ids=batch.group_ids, lease_id=batch.lease_id)
            sent += 1
            confirmation = await anext(requests, None)
            if hold:
                await asyncio.to_thread(self.store.ack, batch.lease_id)
            if confirmation is None or confirmation.stop:
                return


async def main(data: str) -> None:
    store = Store(data)
    store.create_table(TABLE, exist_ok=True)
    server = grpc.aio.server(options=channel_options(256 << 20))
    pb_grpc.add_ExperienceBufferServicer_to_server(AioService(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
