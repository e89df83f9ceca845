"""Calls that wait, ended by their clients: a push waiting for room in a full table or under
max_inflight_bytes, and an Admit waiting for room, stop waiting once their call ends (a cancel, a
client gone), giving back the payload memory, the call slot and the worker they held. Each waited
on until its deadline (or max_wait_seconds, or an hour), holding them, so that other clients'
pushes were refused RESOURCE_EXHAUSTED meanwhile, and a cancelled Admit took the room when it came
back: a grant nobody would finish, and live workers granted nothing until it expired."""

from __future__ import annotations

import _thread
import signal
import threading

import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.app import ExpbufServer

from conftest import Servers
from faultkit import channel, stub
from helpers import make_experience, wait_for

pytestmark = pytest.mark.faults

MB = 1 << 20


def payload(batch: str, response: int = 4) -> bytes:
    """One experience of `response` tokens (9 bytes a token), a group of its own."""
    return trxp.build([trxp.from_experience(make_experience(batch, 0, 0, response=response))])


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    server = start_server(max_inflight_bytes=MB, max_wait_seconds=60, advantage_worker="when_needed")
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("full", capacity_experiences=1, when_full="block")
        client.create_table("other")
    with channel(f"127.0.0.1:{server.port}") as chan:
        stub(chan).Push(pb.PushRequest(table="full", payload=payload("fill")), timeout=30)
    return server


def calls_free(server: ExpbufServer) -> bool:
    """No push holds payload memory, a call slot or a wait."""
    limits = server.call_limits
    return server.inflight.held == 0 and server.inflight.waiting == 0 and limits._calls == 0 and limits._waiting == 0


@pytest.mark.parametrize("method", ["Push", "PushStream"])
def test_a_push_waiting_for_room_in_a_full_table_ends_with_its_call(server: ExpbufServer, method: str) -> None:
    target = f"127.0.0.1:{server.port}"
    chan = channel(target)
    big = pb.PushRequest(table="full", payload=payload("big", response=150_000))  # 1.35 MB, no deadline
    call = stub(chan).Push.future(big) if method == "Push" else stub(chan).PushStream(iter([big]))
    wait_for(lambda: server.inflight.held > 0 and server.call_limits._waiting == 1, "the push to wait for room", 30)
    call.cancel()
    chan.close()
    wait_for(lambda: calls_free(server), "the cancelled push to give back its memory and slot", 10)
    with channel(target) as other:
        reply = stub(other).Push(pb.PushRequest(table="other", payload=payload("x", response=20_000)), timeout=10)
    assert len(reply.stored_uids) == 1


def test_pushes_waiting_for_inflight_room_end_with_their_calls(server: ExpbufServer) -> None:
    target = f"127.0.0.1:{server.port}"
    with channel(target) as holding_chan:
        holder = stub(holding_chan).Push.future(
            pb.PushRequest(table="full", payload=payload("big", response=150_000)), timeout=60
        )
        wait_for(lambda: server.inflight.held > MB, "the large push to hold its payload", 30)
        chan = channel(target)
        waiting = [stub(chan).Push.future(pb.PushRequest(table="other", payload=payload(f"w{n}"))) for n in range(3)]
        wait_for(lambda: server.inflight.waiting == 3, "three pushes to wait for in-flight room", 30)
        for call in waiting:
            call.cancel()
        chan.close()
        wait_for(lambda: server.inflight.waiting == 0, "the cancelled pushes to stop waiting", 10)
        holder.cancel()
    wait_for(lambda: calls_free(server), "every push to give back its memory and slot", 10)


def test_a_cancelled_admit_does_not_take_the_room_that_comes_back(start_server: Servers) -> None:
    server = start_server(max_wait_seconds=60)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.create_table("t", group_size=1, max_staleness=0, batch_size=2)
    with channel(target) as chan:
        first = stub(chan).Admit(pb.AdmitRequest(table="t", count=2), timeout=10)
        assert first.granted == 2
        ghost_chan = channel(target)
        ghost = stub(ghost_chan).Admit.future(pb.AdmitRequest(table="t", count=2, wait_seconds=60))
        wait_for(lambda: server.call_limits._open["waiting_admit"] == 1, "the Admit to wait for room", 30)
        ghost.cancel()
        ghost_chan.close()
        wait_for(lambda: server.call_limits._open["waiting_admit"] == 0, "the cancelled Admit to stop waiting", 10)
        stub(chan).FinishGrant(pb.FinishGrantRequest(table="t", grant_id=first.grant_id, accepted=0), timeout=10)
        live = stub(chan).Admit(pb.AdmitRequest(table="t", count=2, wait_seconds=5), timeout=10)
    assert live.granted == 2


def test_a_blocking_admit_its_caller_left_is_cancelled_at_the_server(start_server: Servers) -> None:
    """A BufferClient.admit(wait=...) interrupted (Ctrl-C, ray.cancel's interrupt of its thread)
    raises in its caller, and gRPC's blocking call cancels it at the server: it stops waiting, and
    the room that comes back goes to a live worker, not to a grant whose name no one saw. (A helper's
    audit found a grant taken where the room came back within milliseconds of the interrupt, before
    the cancel reached the server.) Python's own SIGINT handler for the test: pytest-xdist's workers
    ignore the signal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server = start_server(max_wait_seconds=60)
        target = f"127.0.0.1:{server.port}"
        with BufferClient(target) as admin, BufferClient(target) as worker:
            admin.create_table("t", group_size=1, max_staleness=0, batch_size=2)
            held = admin.admit("t", 2)

            def interrupt() -> None:
                wait_for(lambda: server.call_limits._open["waiting_admit"] == 1, "the admit to wait for room", 30)
                _thread.interrupt_main()

            interrupting = threading.Thread(target=interrupt)
            interrupting.start()
            with pytest.raises(KeyboardInterrupt):
                worker.admit("t", 2, wait=60)
            interrupting.join()
            wait_for(lambda: server.call_limits._open["waiting_admit"] == 0, "the left admit to stop waiting", 10)
            admin.finish_grant(held, 0)
            assert worker.admit("t", 2, wait=5).count == 2
    finally:
        signal.signal(signal.SIGINT, previous)
