"""The sharded clients' poll planner, alone: no server and no clock, only its decisions.

The sharded client tests (test_sharding.py, faults/test_fault_shards.py) run it against real
shards; here each rule is pinned: what is asked of which shard, how the wait grows, and why it gives up.
"""

from __future__ import annotations

import grpc
import pytest

from expbuf.client.errors import DeadlineExceededError
from expbuf.client.rpc.sample_spec import SampleSpec
from expbuf.client.shards.common import ShardError
from expbuf.client.shards.poll import POLL_SECONDS, Ask, Done, GiveUp, Poll, Wait


def test_a_batch_the_shards_can_fill_is_asked_in_proportion_to_what_each_holds() -> None:
    poll = Poll(SampleSpec("t", num_groups=4, timeout=10), ["a", "b"], now=0.0)
    step = poll.look({"a": 6, "b": 2}, now=0.0)
    assert step == Ask({"a": 3, "b": 1}, late=False)
    assert poll.took([3, 1], now=0.1) == Done(partial=False)


def test_too_few_ready_waits_doubling_up_to_the_cap_and_never_past_the_deadline() -> None:
    poll = Poll(SampleSpec("t", batch_size=8, timeout=10.0), ["a"], now=0.0)
    pauses = []
    for now in (0.0, 0.02, 0.06, 0.14, 0.3, 0.62):
        step = poll.look({"a": 3}, now=now)
        assert isinstance(step, Wait)
        pauses.append(step.seconds)
    assert pauses[:5] == [POLL_SECONDS[0] * 2**i for i in range(5)]
    assert pauses[5] == POLL_SECONDS[1]
    assert poll.look({"a": 3}, now=9.9).seconds == pytest.approx(0.1)


def test_a_shard_that_does_not_answer_is_left_out_of_the_ask() -> None:
    poll = Poll(SampleSpec("t", num_groups=2, timeout=5), ["a", "b"], now=0.0)
    assert poll.look({"b": 5}, now=0.0) == Ask({"b": 2}, late=False)


def test_when_the_wait_runs_out_what_is_there_is_asked_for_and_sent_as_partial() -> None:
    poll = Poll(SampleSpec("t", num_groups=4, timeout=1.0), ["a", "b"], now=0.0)
    assert isinstance(poll.look({"a": 1}, now=0.5), Wait)
    assert poll.look({"a": 1, "b": 1}, now=1.0) == Ask({"a": 1, "b": 1}, late=True)
    assert poll.took([1, 1], now=1.0) == Done(partial=True)


def test_a_part_taken_by_another_trainer_meanwhile_is_asked_again() -> None:
    poll = Poll(SampleSpec("t", num_groups=2, timeout=5), ["a"], now=0.0)
    assert poll.look({"a": 2}, now=0.0) == Ask({"a": 2}, late=False)
    assert isinstance(poll.took([], now=0.1), Wait)  # nothing came back: look again
    assert poll.look({"a": 2}, now=0.2) == Ask({"a": 2}, late=False)
    assert poll.took([2], now=0.3) == Done(partial=False)


def test_a_part_given_back_unused_is_asked_for_again_or_the_batch_goes_without_it_once_late() -> None:
    """A part held too long to be confirmed in time goes back to its shard: the poll counts it no
    more, and asks for what it held again while the wait lasts; once late, the batch goes out with
    the parts still held (partial), or, with none, not at all."""
    poll = Poll(SampleSpec("t", num_groups=4, timeout=5), ["a", "b"], now=0.0)
    assert poll.look({"a": 2, "b": 2}, now=0.0) == Ask({"a": 2, "b": 2}, late=False)
    assert isinstance(poll.took([2], now=0.1), Wait)  # b's part did not come
    assert isinstance(poll.returned([2], now=0.2), Wait)  # a's went back before its shard's limit
    assert poll.look({"a": 2, "b": 2}, now=0.3) == Ask({"a": 2, "b": 2}, late=False)
    assert poll.took([2, 2], now=0.4) == Done(partial=False)

    late = Poll(SampleSpec("t", num_groups=4, timeout=1.0), ["a", "b"], now=0.0)
    assert late.look({"a": 2, "b": 2}, now=1.0) == Ask({"a": 2, "b": 2}, late=True)
    assert late.took([2, 2], now=1.0) == Done(partial=False)
    assert late.returned([2], now=1.1) == Done(partial=True)
    step = late.returned([2], now=1.2)
    assert isinstance(step, GiveUp) and isinstance(step.error, DeadlineExceededError)


def test_nothing_in_time_gives_up_with_why() -> None:
    late = Poll(SampleSpec("t", num_groups=2, timeout=1.0), ["a"], now=0.0)
    step = late.look({"a": 0}, now=1.0)
    assert isinstance(step, GiveUp) and isinstance(step.error, DeadlineExceededError)
    assert "fewer than 2 ready groups after 1.0s" in str(step.error)

    partial = Poll(SampleSpec("t", batch_size=3, timeout=1.0, allow_partial=True), ["a"], now=0.0)
    assert partial.look({"a": 0}, now=2.0) == GiveUp(None)  # the end of the stream, quietly

    down = Poll(SampleSpec("t", num_groups=1, timeout=0.0), ["a", "b"], now=0.0)
    step = down.look({}, now=0.0)
    assert isinstance(step, GiveUp) and isinstance(step.error, ShardError)
    assert step.error.code == grpc.StatusCode.UNAVAILABLE and step.error.shards == ["a", "b"]
