"""The bounds on concurrent calls (server/rpc/interceptors/limits.py) as they are counted, whatever the order in
which calls arrive: the number of calls let wait idle depends on the workers, the reserve and the
shares only, never on how many calls that answer at once happened to be in progress."""

from __future__ import annotations

from collections.abc import Callable

from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.rpc.interceptors.limits import CallLimits

WORKERS, RESERVED = 16, 2


def limits(shares: dict[str, int] | None = None) -> CallLimits:
    return CallLimits(WORKERS, RESERVED, {}, shares or {})


def test_pushes_that_all_start_before_any_must_wait_leave_the_reserve_and_no_more() -> None:
    """18 pushes into a full table: 16 take a worker, then each finds it must wait. All but the
    reserve wait (14), whether each reached its wait before the next started or all started first
    (on a loaded machine the second happened, and the pushes let wait were 12)."""
    calls = limits()
    slots = [calls.acquire("Push", pb.PushRequest()) for _ in range(WORKERS + 2)]
    refused_at_once = [slot for slot in slots if isinstance(slot, str)]
    assert len(refused_at_once) == 2 and all(f"all workers = {WORKERS}" in r for r in refused_at_once)
    started = [slot for slot in slots if not isinstance(slot, str)]
    waits = [slot.may_wait() for slot in started]
    assert waits.count(None) == WORKERS - RESERVED
    refusals = [why for why in waits if why is not None]
    assert all(f"reserved_workers = {RESERVED}" in why for why in refusals), refusals


def test_a_push_that_waits_counts_as_waiting_until_it_ends() -> None:
    """Once let wait, a push holds a waiting call's place until it ends: a Sample stream (which
    waits idle) is refused beside 14 waiting pushes, and let in once one of them ends."""
    calls = limits()
    pushes = [calls.acquire("Push", pb.PushRequest()) for _ in range(WORKERS - RESERVED)]
    for push in pushes:
        assert not isinstance(push, str) and push.may_wait() is None
    refused = calls.acquire("Sample", None)
    assert isinstance(refused, str) and f"reserved_workers = {RESERVED}" in refused
    pushes[0].release()
    assert not isinstance(calls.acquire("Sample", None), str)
    pushes[0].release()  # a second release of the same call counts nothing
    assert isinstance(calls.acquire("Sample", None), str)


def test_calls_that_answer_at_once_may_take_the_reserve_beside_waiting_ones() -> None:
    """14 calls waiting idle leave 2 workers, which calls that answer at once take."""
    calls = limits()
    for _ in range(WORKERS - RESERVED):
        assert not isinstance(calls.acquire("Sample", None), str)
    answered: list[Callable[[], None]] = []
    for _ in range(RESERVED):
        slot = calls.acquire("Get", pb.GetRequest())
        assert not isinstance(slot, str)
        answered.append(slot.release)
    assert "all workers" in str(calls.acquire("Get", pb.GetRequest()))


def test_a_waiting_push_leaves_the_other_scopes_share() -> None:
    """With 4 workers kept for sample-scope calls, pushes let wait stop 4 short of the reserve."""
    calls = limits({"push": 0, "sample": 4})
    pushes = [calls.acquire("Push", pb.PushRequest()) for _ in range(WORKERS - 4)]
    waits = [push.may_wait() for push in pushes if not isinstance(push, str)]
    assert waits.count(None) == WORKERS - RESERVED - 4
    assert all("sample_scope_workers = 4" in why for why in waits if why is not None)
