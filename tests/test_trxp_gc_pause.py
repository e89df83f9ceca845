"""A batch decoded without the garbage collector's passes (client/trxp/codec/gc_pause.py): none
runs while a batch decodes, whatever it allocates; the collector is left as the caller had it
(running, or disabled by the caller), after a refused payload too; nested and concurrent decodes
hold it off until the last one ends; a process forked during a decode runs its collector."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

import pytest

from expbuf.client import TrxpError, trxp
from expbuf.client.trxp.codec.gc_pause import collector_paused

from helpers import make_experience, passes_started

ITEMS = 512  # a dozen tracked objects an item: many times the threshold set below


@pytest.fixture
def collections() -> Iterator[list[bool]]:
    """A record of each collection that starts on the test's thread while the test runs (pytest's own
    threads' are left out), with the collector running and its first threshold low (so a decode
    that let it run would bring on several)."""
    with passes_started(thread=threading.get_ident()) as started:
        yield started


@pytest.fixture(scope="module")
def reply() -> bytes:
    """A batch as a sample's reply carries it: the stored items spliced."""
    items = trxp.parse(trxp.encode([make_experience(0, task, 0) for task in range(ITEMS)]))
    return trxp.join([trxp.pack_item(item) for item in items])


def test_no_collection_runs_while_a_batch_decodes(collections: list[bool], reply: bytes) -> None:
    """A decode's thousands of tracked objects bring on about 190 passes at this threshold without
    the pause; with it, the one due when the collector runs again (at the decode's last allocation,
    or the caller's next), and at most a few more where another thread of the process (an xdist
    worker's) allocates in the moment before the count is read."""
    made = trxp.decode_reply(reply)
    during = len(collections)  # read without allocating a tracked object, which could start a pass
    assert len(made) == ITEMS
    assert during < 10
    assert gc.isenabled()
    before = len(collections)
    trxp.decode(reply)
    during = len(collections) - before
    assert during < 10
    assert gc.isenabled()
    before = len(collections)
    objects = [[] for _ in range(1000)]  # the collector runs again: tracked allocations bring on passes
    assert len(collections) > before and objects


def test_a_collector_the_caller_disabled_stays_disabled(collections: list[bool], reply: bytes) -> None:
    gc.disable()
    trxp.decode_reply(reply)
    assert not gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_refused_payload_leaves_the_collector_running(collections: list[bool], reply: bytes) -> None:
    damaged = bytearray(reply)
    damaged[:4] = b"XXXX"
    with pytest.raises(TrxpError, match="magic"):
        trxp.decode_reply(bytes(damaged))
    assert gc.isenabled()


@contextlib.contextmanager
def decoding_elsewhere() -> Iterator[None]:
    """A decode under way on another thread for the length of the block."""
    inside, leave = threading.Event(), threading.Event()

    def decoding() -> None:
        with collector_paused():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=decoding)
    thread.start()
    try:
        assert inside.wait(30)
        yield
    finally:
        leave.set()
        thread.join(30)


def test_nested_and_concurrent_decodes_hold_it_off_until_the_last_ends(collections: list[bool]) -> None:
    with contextlib.ExitStack() as other:
        with collector_paused():
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer one still runs
            other.enter_context(decoding_elsewhere())
        assert not gc.isenabled()  # the other thread's decode still runs
        before = len(collections)
        objects = [[] for _ in range(1000)]
        assert len(collections) == before and objects
    assert gc.isenabled()


def test_a_process_forked_during_a_decode_runs_its_collector(collections: list[bool]) -> None:
    """A decode on another thread when a process forks (a DataLoader's workers) is not copied into
    the child: its collector must not stay held off for good, nor its next decode wait on a lock
    the decoding thread held."""
    with decoding_elsewhere():
        assert not gc.isenabled()
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: report, then leave without running the parent's handlers
            try:
                running = gc.isenabled()
                with collector_paused():
                    held = not gc.isenabled()
                os.write(write, b"%d%d%d" % (running, held, gc.isenabled()))
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            reported = pipe.read()
        os.waitpid(child, 0)
        assert reported == b"111"  # running after the fork, held off by its own decode, running again
        assert not gc.isenabled()  # the parent's decode still runs
    assert gc.isenabled()
