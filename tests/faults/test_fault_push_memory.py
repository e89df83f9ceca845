"""Large pushes against an `expbuf serve` child: the payload bytes that pushes in progress
hold are capped by max_inflight_bytes (pushes past it wait for their deadline, then are
refused naming the setting), an experience's metadata by max_metadata_bytes, and the
server's memory does not grow from one large push to the next.

The memory figures are printed (run with -s to see them); bench/RESULTS.md has them for larger
pushes. RSS is asserted loosely: memory, not time. Each child loads torch at its start (AT_START):
its first push to a table with an estimator would load it in the middle of what is measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb

from faultkit import _status_bytes, channel, peak_rss_bytes, reset_peak_rss, stub, trimmed
from helpers import ServerProcess, make_experience

pytestmark = pytest.mark.faults

MB = 1 << 20
AT_START = ("--advantage-worker", "at_start")  # torch's 190 MiB loaded before anything is measured


def large_payload(batch: str, experiences: int, response: int) -> bytes:
    """Experiences of one token-heavy response each (9 bytes a token), each its own group."""
    return trxp.build(
        [trxp.from_experience(make_experience(batch, task, 0, response=response)) for task in range(experiences)]
    )


def metadata_payload(batch: str, experiences: int, size: int) -> bytes:
    """Experiences of 7 tokens, each carrying `size` bytes in its info: a bytes value in the metadata pickle."""
    items = [trxp.from_experience(make_experience(batch, task, 0)) for task in range(experiences)]
    for item in items:
        item.meta["info"]["blob"] = bytes(size)
    return trxp.build(items)


def test_pushes_past_max_inflight_bytes_wait_then_are_refused_naming_it(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    server = serve(str(tmp_path / "data"), "--max-inflight-bytes", str(2 * MB), *AT_START)
    with BufferClient(server.target) as client:
        client.create_table("full", capacity_experiences=1, when_full="block")
        client.create_table("other")
    with channel(server.target) as chan:
        buffer = stub(chan)
        buffer.Push(pb.PushRequest(table="full", payload=large_payload("fill", 1, 16)), timeout=30)
        # A 3 MiB push waits for room in the full table: it holds its payload, past the cap, meanwhile.
        holding = buffer.Push.future(pb.PushRequest(table="full", payload=large_payload("big", 1, 350_000)), timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if buffer.Stats(pb.StatsRequest(table="full"), timeout=10).tables[0].pushed == 1 and not holding.done():
                break
        small = large_payload("small", 1, 16)
        refused = None
        for _ in range(20):  # until the holding push has been read (the cap then makes the others wait)
            try:
                buffer.Push(pb.PushRequest(table="other", payload=small), timeout=3)
            except grpc.RpcError as exc:
                refused = exc
                break
        assert refused is not None, "pushes went on while a push held more than max_inflight_bytes"
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (refused.code(), refused.details())
        assert f"max_inflight_bytes = {2 * MB}" in refused.details(), refused.details()
        waiting = buffer.Push.future(pb.PushRequest(table="other", payload=large_payload("late", 1, 16)), timeout=60)
        assert not waiting.done()
        assert buffer.Stats(pb.StatsRequest(table="other"), timeout=10).tables[0].pushed <= 20
        batches = BufferClient(server.target).sample(
            "full", num_groups=1, max_batches=1, timeout=10, delivery="consume"
        )
        uids = [uid for batch in batches for uid in batch.uids]
        assert uids == ["fill/0/0/0/r0s0"]  # room: the holding push is stored, the waiting one read
        assert len(holding.result(timeout=30).stored_uids) == 1
        assert len(waiting.result(timeout=30).stored_uids) == 1


def test_concurrent_large_pushes_memory_is_bounded_and_returned(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    server = serve(str(tmp_path / "data"), *AT_START, fresh=True)
    pid = server.proc.pid
    payloads = [large_payload(f"b{i}", 6, 1 << 20) for i in range(4)]  # 4 x 54 MiB
    in_flight = sum(len(p) for p in payloads)
    with channel(server.target) as chan:
        buffer = stub(chan)
        buffer.Push(pb.PushRequest(payload=large_payload("warm", 1, 16)), timeout=30)
        trimmed(pid, 1.0)
        base = reset_peak_rss(pid)
        errors: list[Exception] = []

        def push(payload: bytes) -> None:
            try:
                buffer.Push(pb.PushRequest(payload=payload), timeout=120)
            except grpc.RpcError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=push, args=(p,)) for p in payloads]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        trimmed(pid, 2.0)
        peak, after = peak_rss_bytes(pid), _status_bytes(pid, "VmRSS")
    print(
        f"\n4 concurrent pushes of {in_flight // 4 // MB} MiB ({in_flight // MB} MiB in flight): server RSS "
        f"{base // MB} MiB before, {peak // MB} MiB peak (+{(peak - base) / in_flight:.2f}x in flight), "
        f"{after // MB} MiB after (+{(after - base) // MB} MiB)"
    )
    assert peak - base < 5 * in_flight, "a push costs more than gRPC's receive and one packed copy"
    assert after - base < in_flight, "the pushes' memory stays after them"


def test_an_experience_past_max_metadata_bytes_is_refused_naming_it_and_its_memory_returned(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """64 MiB in one experience's info, past max_metadata_bytes (here 4 MiB): refused before it
    is packed, having cost gRPC's receive and the metadata's objects, and given back.
    (The same push first: the heap and gRPC's buffers reach the sizes such a push takes, and
    keep them for the next; the memory measured is what the second leaves beyond that.)"""
    server = serve(str(tmp_path / "data"), "--max-metadata-bytes", str(4 * MB), *AT_START, fresh=True)
    pid = server.proc.pid
    body = metadata_payload("one", 1, 64 * MB)
    with channel(server.target) as chan:
        buffer = stub(chan)
        with pytest.raises(grpc.RpcError):
            buffer.Push(pb.PushRequest(payload=body), timeout=120)
        trimmed(pid, 1.0)
        base, base_anon = reset_peak_rss(pid), _status_bytes(pid, "RssAnon")
        with pytest.raises(grpc.RpcError) as refused:
            buffer.Push(pb.PushRequest(payload=body), timeout=120)
        trimmed(pid, 2.0)
        peak, after = peak_rss_bytes(pid), _status_bytes(pid, "RssAnon")
        assert buffer.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 0
        assert buffer.Push(pb.PushRequest(payload=metadata_payload("small", 2, MB)), timeout=30).stored_uids
    print(
        f"\na refused push of {len(body) // MB} MiB in one info: server RSS {base // MB} MiB before, "
        f"{peak // MB} MiB peak (+{(peak - base) / len(body):.2f}x); anonymous memory {base_anon // MB} MiB before, "
        f"{after // MB} MiB after (+{(after - base_anon) // MB} MiB)"
    )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    details = refused.value.details()
    assert details.startswith("item 0 (uid one/0/0/0/r0s0): its metadata takes 671"), details
    assert "max_metadata_bytes = 4194304" in details and "EXPBUF_MAX_METADATA_BYTES" in details, details
    assert peak - base < 5 * len(body), "a refused push costs more than gRPC's receive, a scan and its objects"
    assert after - base_anon < len(body), "the refused push's memory stays after it"


@pytest.mark.parametrize(
    ("name", "body", "bound"),
    [
        ("126 MiB of tensors", lambda batch: large_payload(batch, 14, 1 << 20), 2.5),
        # Metadata costs more: its pickle is scanned from a copy, and an experience's is held twice
        # while it is packed (measured +2.3x to +2.6x here quiet, 3.02-3.09x busy: a copy more is 4x).
        ("64 MiB as 16 infos of 4 MiB", lambda batch: metadata_payload(batch, 16, 4 * MB - 4096), 3.5),
    ],
)
def test_a_large_push_in_chunks_holds_about_twice_its_size_and_keeps_none_of_it(
    tmp_path: Path, serve: Callable[..., ServerProcess], name: str, body: Callable[[str], bytes], bound: float
) -> None:
    """A push sent in chunks (the client's default past 4 MiB): the server holds the payload and
    its packed copy, not gRPC's copies of one message besides, and keeps none of it: pushes of the
    same size, one after another, do not grow it. (What one push leaves, the C library may keep
    for the next, up to its trim threshold: reply memory is kept so, replies.keep_reply_memory.)"""
    server = serve(str(tmp_path / "data"), *AT_START, fresh=True)
    pid = server.proc.pid
    data = body("measured")
    with BufferClient(server.target, timeout=120) as client:
        client.push(large_payload("warm", 2, 1 << 20))  # 18 MiB, in chunks
        trimmed(pid, 1.0)
        base, base_anon = reset_peak_rss(pid), _status_bytes(pid, "RssAnon")
        stored = client.push(data).stored
        trimmed(pid, 2.0)
        peak, after = peak_rss_bytes(pid), _status_bytes(pid, "RssAnon")
        for again in range(3):  # the same size, new uids
            assert len(client.push(body(f"again{again}")).stored) == len(stored)
        trimmed(pid, 2.0)
        later = _status_bytes(pid, "RssAnon")
        base_again = reset_peak_rss(pid)  # a second measured push: the peak of the better of the two
        for again in range(3, 6):  # and three more: a push that kept its memory would add 3 sizes
            assert len(client.push(body(f"again{again}")).stored) == len(stored)
            if again == 3:
                peak_again = peak_rss_bytes(pid)
        trimmed(pid, 2.0)
        latest = _status_bytes(pid, "RssAnon")
    print(
        f"\none push of {name} ({len(data) // MB} MiB) in chunks: server RSS {base // MB} MiB before, "
        f"{peak // MB} MiB peak (+{(peak - base) / len(data):.2f}x, "
        f"+{(peak_again - base_again) / len(data):.2f}x for the next); anonymous memory {base_anon // MB} MiB before, "
        f"{after // MB} MiB after (+{(after - base_anon) // MB} MiB), {later // MB} MiB after 3 more, "
        f"{latest // MB} MiB after 6"
    )
    assert len(stored) in (14, 16)
    # The better of two pushes: on a busy machine one push's peak has measured 3.02-3.09x of the
    # metadata payload (2.3-2.6x quiet; both pushes 3.03x in a clean clone's CI on four workers); a
    # push that held another copy would raise both past 3.5x.
    lower = min(peak - base, peak_again - base_again)
    assert lower < bound * len(data), "a push in chunks costs more than its payload and its packed copy"
    assert after - base_anon < len(data), "one push leaves more than its own size behind"
    # The C library may keep what a push freed in the arena of the thread that served it (a busy
    # machine spreads pushes over more of them), once; three pushes after that, less than one
    # push's size in all (measured -15 to +57 MiB for 126 MiB pushes): a push that kept a third
    # of itself would add a whole one.
    assert later - after < len(data), "each push's memory stays after it"
    assert latest - later < len(data), "each push's memory stays after it"
