"""A sharded sample's parts, each held on a Sample stream of its own until the whole batch is in
hand: what a part its shard cannot give, or whose confirmation fails (its shard stopped, its table
dropped, past max_confirm_seconds), does to the batch the trainer gets and to what the client
believes of the shard. Two in-process shards on loopback, real LMDB; the plan alone where its
outcomes are answered here."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from expbuf.client import BufferClient, ExpbufError
from expbuf.client.rpc.calls.sample_stream import late
from expbuf.client.schema.reasons import Reason
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient, ShardError
from expbuf.client.shards.poll import POLL_SECONDS, Wait

from conftest import Servers
from helpers import SlowReplies, make_experience
from test_sharding import drain, groups, in_process_shards

Sharded = ShardedBufferClient | AsyncShardedBufferClient
KINDS = [ShardedBufferClient, AsyncShardedBufferClient]


def delivering(step: Any) -> bool:
    """Whether `step` confirms a batch's held parts."""
    return isinstance(step, list) and any(call.method == "deliver" for call in step)


def before_delivery(act: Callable[[], None]) -> Callable[[Any], None]:
    """A hook for `samples` that runs `act` as each batch's held parts are about to be confirmed."""
    return lambda step: act() if delivering(step) else None


def samples(
    kind: type[Sharded],
    targets: dict[str, str],
    asks: list[dict[str, Any]],
    before: Callable[[Any], None] = lambda step: None,
) -> list[tuple[Any, set[str]]]:
    """Each sample asked in turn of one client of `kind` (the asyncio one's on a loop of its own),
    `before` called with each step of its plan (shard calls, a pause) before it is made: its
    batches, as a list, or the ShardError it raised; and the shards the client then believes down."""
    if kind is ShardedBufferClient:
        with ShardedBufferClient(targets, timeout=5.0) as client:
            blocking = client._step

            def step_of(step: Any) -> Any:
                before(step)
                return blocking(step)

            client._step = step_of  # type: ignore[method-assign]
            return [(outcome(client, ask), set(client._down)) for ask in asks]

    async def gather() -> list[tuple[Any, set[str]]]:
        async with AsyncShardedBufferClient(targets, timeout=5.0) as client:
            driven = client._step

            async def step(step: Any) -> Any:
                before(step)
                return await driven(step)

            client._step = step  # type: ignore[method-assign]
            out = []
            for ask in asks:
                try:
                    got: Any = [batch async for batch in client.sample("t", **ask)]
                except ShardError as exc:
                    got = exc
                out.append((got, set(client._down)))
            return out

    return asyncio.run(gather())


def outcome(client: ShardedBufferClient, ask: dict[str, Any]) -> Any:
    """The batches of a sample of table t, as a list, or the ShardError it raised."""
    try:
        return list(client.sample("t", **ask))
    except ShardError as exc:
        return exc


def versioned(client: ShardedBufferClient, batch: int, versions: dict[str, int]) -> list:
    """One group of two on each shard named, of the model version given for it."""
    owner = client.shard_map.owner
    tasks = {shard: next(t for t in range(1000) if owner(f"{batch}/{t}") == shard) for shard in versions}
    return [make_experience(batch, tasks[shard], run, version=v) for shard, v in versions.items() for run in range(2)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_whose_part_ran_out_of_its_wait_is_not_believed_down(
    start_server: Servers, tmp_path: Path, kind: type[Sharded]
) -> None:
    """A part its shard could not fill within its wait (its groups older than min_model_version:
    DEADLINE_EXCEEDED, reason not_ready) is the shard's answer: the sample leaves the shard
    believed up, so that its next calls go as to a live shard (the client's deadline and
    retries), not as probes of one down (one short try)."""
    targets, _ = in_process_shards(start_server, tmp_path)
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=2, estimator="none")
        setup.push(versioned(setup, 0, {"free": 0, "full": 5}), table="t")
    ((batches, down),) = samples(kind, targets, [{"batch_size": 2, "min_model_version": 5, "max_batches": 1}])
    assert [batch.shards for batch in batches] == [["full"]]
    assert down == set()


def test_a_held_part_confirmed_too_late_leaves_its_shard_believed_up() -> None:
    """The delivery plan alone, each part's outcome answered here: a part the client found too late
    to confirm for its shard's max_confirm_seconds (HeldBatch.deliver's error), or that its shard
    ended so (unconfirmed), is left out with its shard believed up: the shard handed it over. A
    part whose shard went away (UNAVAILABLE) leaves it believed down."""
    too_late = late("t", 0.2, time.monotonic() - 1.0)
    unconfirmed = ExpbufError(grpc.StatusCode.DEADLINE_EXCEEDED, "not confirmed in time", Reason.UNCONFIRMED)
    gone = ExpbufError(grpc.StatusCode.UNAVAILABLE, "shutting down", Reason.SHUTTING_DOWN)
    with ShardedBufferClient({"s0": "127.0.0.1:1", "s1": "127.0.0.1:2", "s2": "127.0.0.1:3"}) as client:
        plan = client._deliver([(shard, object()) for shard in ("s0", "s1", "s2")])
        assert [(call.shard, call.method) for call in next(plan)] == [(s, "deliver") for s in ("s0", "s1", "s2")]
        assert too_late is not None
        with pytest.raises(ShardError) as none_delivered:
            plan.send([too_late, unconfirmed, gone])
        assert none_delivered.value.shards == ["s0", "s1", "s2"]
        assert client._down == {"s2"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_part_held_past_its_shards_max_confirm_seconds_is_left_out_and_taken_again(
    start_server: Servers, tmp_path: Path, kind: type[Sharded]
) -> None:
    """A part held while the poll waits for more goes back to its buffer before its shard's
    max_confirm_seconds, and is taken again: the batch that goes out at the sample's timeout holds
    it once, not as well as an older part of the same groups, and the shard counts it sampled once."""
    # a bound of 1 s, not less: a part fetched must reach its delivery within it on a loaded machine
    targets, _ = in_process_shards(start_server, tmp_path, max_confirm_seconds=1.0)
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=2, estimator="none")
        setup.push(versioned(setup, 0, {"free": 0, "full": 5}), table="t")
    # free's part never comes (its group too old); full's, held meanwhile, would outlast its 1 s
    ask = {"batch_size": 4, "min_model_version": 5, "max_batches": 1, "delivery": "consume", "timeout": 3.0}
    (([batch], down),) = samples(kind, targets, [ask])
    assert batch.shards == ["full"] and batch.partial and len(batch.uids) == len(set(batch.uids)) == 2
    assert down == set()
    with ShardedBufferClient(targets) as after:
        stats = after.shard_stats("t")["full"]["t"]
        assert (stats.ready, stats.consumed, stats.sampled) == (0, 2, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_part_held_while_the_poll_waits_goes_back_before_its_shards_limit_and_the_batch_comes_whole(
    start_server: Servers, tmp_path: Path, kind: type[Sharded]
) -> None:
    """A sample's timeout (30 s) far above a shard's max_confirm_seconds (1 s): that shard's part,
    held while the poll waits for the other shard's, goes back to its buffer before its limit, and
    is taken again once the other shard has its part, so the trainer gets the whole batch it asked
    for, not partial, each experience once, and the shard counts each delivered once."""
    limit = 1.0
    targets, _ = in_process_shards(start_server, tmp_path, max_confirm_seconds=limit)
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=2, estimator="none")
        setup.push(versioned(setup, 0, {"free": 0, "full": 5}), table="t")
        fresh = versioned(setup, 1, {"free": 5})
        stale = sorted({f"{item.eid.batch}/{item.eid.task}" for item in versioned(setup, 0, {"free": 0})})
    waits: list[float] = []
    fulls_taken: list[Any] = []
    fresh_pushed: list[bool] = []

    def meanwhile(step: Any) -> None:
        """Once the poll has waited past the limit three times over, free's part becomes there:
        its too-old group replaced by one of version 5."""
        if isinstance(step, list):
            fulls_taken.extend(call for call in step if (call.shard, call.method) == ("full", "_hold"))
        if not isinstance(step, Wait):
            return
        waits.append(time.monotonic())
        if waits[-1] - waits[0] >= 3 * limit and not fresh_pushed:
            with BufferClient(targets["free"]) as free:
                free.delete(table="t", groups=stale)
                free.push(fresh, table="t")
            fresh_pushed.append(True)

    ask = {"batch_size": 4, "min_model_version": 5, "max_batches": 1, "delivery": "consume", "timeout": 30.0}
    (([batch], down),) = samples(kind, targets, [ask], meanwhile)
    assert (sorted(batch.shards), batch.partial, len(batch.uids)) == (["free", "full"], False, 4)
    assert len(set(batch.uids)) == 4 and down == set() and fresh_pushed
    assert len(fulls_taken) >= 2  # its part went back, and was taken again
    with ShardedBufferClient(targets) as after:
        for shard, stats in after.shard_stats("t").items():
            assert (stats["t"].ready, stats["t"].consumed, stats["t"].sampled) == (0, 2, 2), shard


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["stopped", "dropped"])
def test_a_part_whose_shard_fails_its_confirmation_is_left_out_and_not_counted(
    start_server: Servers, tmp_path: Path, kind: type[Sharded], fault: str
) -> None:
    """Between a batch's parts held and their confirmation, one shard stops (or its table is dropped
    and made again): the trainer gets the other shard's part alone, `partial` set; the stopped
    shard's part went back to its buffer, not counted as sampled, and comes once when it is back
    (the table made again holds nothing of the old one's part): no experience lost or twice."""
    targets, full = in_process_shards(start_server, tmp_path)
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=2, estimator="none")
        setup.push(groups(0, range(8), range(2)), table="t")
        on = {shard: stats["t"].ready for shard, stats in setup.shard_stats("t").items()}
    assert on["free"] and on["full"]

    def fail() -> None:
        if fault == "stopped":
            start_server.stop(full)
        else:
            with BufferClient(targets["full"]) as one:
                one.drop_table("t")
                one.create_table("t", group_size=2, estimator="none")

    ask = {"num_groups": 8, "max_batches": 1, "delivery": "consume", "timeout": 5.0}
    (([batch], down),) = samples(kind, targets, [ask], before_delivery(fail))
    assert batch.shards == ["free"] and batch.partial and len(batch.uids) == on["free"]
    assert down == ({"full"} if fault == "stopped" else set())
    if fault == "stopped":
        start_server(tmp_path / "full", port=full.port)
    with ShardedBufferClient(targets, timeout=10.0) as after:
        stats = after.shard_stats("t")["full"]["t"]
        held = on["full"] if fault == "stopped" else 0
        assert (stats.ready, stats.consumed, stats.sampled) == (held, 0, 0)
        rest = [uid for more in drain(after, "t", num_groups=8) for uid in more.uids]
    assert Counter([*batch.uids, *rest]) == Counter({uid: 1 for uid in [*batch.uids, *rest]})
    assert len(rest) == held


@pytest.mark.parametrize("kind", KINDS)
def test_parts_that_come_in_different_rounds_make_a_whole_batch_under_a_short_max_confirm_seconds(
    start_server: Servers, tmp_path: Path, kind: type[Sharded]
) -> None:
    """A shard's max_confirm_seconds (full's, 0.45 s) below the poll's longest pause (0.5 s), and
    the shards' parts never both there in one round: another trainer leases free's group whenever
    the sharded trainer asks both shards at once, or asks late (its timeout passed), and gives it
    back at the trainer's next pause. The part full gave waits, held, for free's to come in a later
    round, so the trainer gets the whole batch before its timeout, not a partial one at it: each
    experience once, full's counted sampled once (free's leases by the other trainer count too)."""
    targets, _ = in_process_shards(start_server, tmp_path, max_confirm_seconds=0.45)
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=2, estimator="none")
        setup.push(versioned(setup, 0, {"free": 5}), table="t")
        later = versioned(setup, 1, {"full": 5})
    leased: list[Any] = []
    with BufferClient(targets["free"]) as other, BufferClient(targets["full"]) as rollout:

        def meanwhile(step: Any) -> None:
            """full's group comes once the poll pauses its longest; the other trainer takes free's
            group before each fetch from both shards and gives it back at the next pause."""
            if isinstance(step, Wait):
                for batch in leased:
                    batch.nack()
                leased.clear()
                if step.seconds == POLL_SECONDS[1] and later:
                    rollout.push(later, table="t")
                    later.clear()
            elif len(asked := [call.args[0] for call in step if call.method == "_hold"]) == 2 or any(
                part.allow_partial for part in asked
            ):
                leased.extend(other.sample("t", num_groups=1, max_batches=1, delivery="lease", timeout=5.0))

        ask = {"num_groups": 2, "max_batches": 1, "delivery": "consume", "timeout": 10.0}
        (([batch], down),) = samples(kind, targets, [ask], meanwhile)
    assert (sorted(batch.shards), batch.partial, len(batch.uids)) == (["free", "full"], False, 4)
    assert len(set(batch.uids)) == 4
    assert down == set() and not later
    with ShardedBufferClient(targets) as after:
        stats = {shard: one["t"] for shard, one in after.shard_stats("t").items()}
    assert [(stats[shard].ready, stats[shard].consumed) for shard in ("free", "full")] == [(0, 2), (0, 2)]
    assert stats["full"].sampled == 2


def behind_a_proxy(start_server: Servers, root: Path) -> tuple[dict[str, str], SlowReplies, dict[str, int]]:
    """Two in-process shards, "full" reached through a SlowReplies proxy, with table t of groups on
    both: their targets, the proxy, and each shard's ready count."""
    free = start_server(root / "free")
    proxy = SlowReplies(f"127.0.0.1:{start_server(root / 'full').port}")
    targets = {"free": f"127.0.0.1:{free.port}", "full": proxy.target}
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=2, estimator="none")
        setup.push(groups(0, range(8), range(2)), table="t")
        on = {shard: stats["t"].ready for shard, stats in setup.shard_stats("t").items()}
    assert on["free"] and on["full"]
    return targets, proxy, on


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_that_stops_answering_as_its_part_is_held_leaves_it_out_in_bounded_time(
    start_server: Servers, tmp_path: Path, kind: type[Sharded]
) -> None:
    """One shard answers the ready probe, then says nothing more (a frozen process, a partition with
    no reset) as the parts are asked for: its part's stream had no deadline, so the sample waited
    for it for good, the other shard's part held meanwhile. Each part's stream now ends within the
    time the batch is gathered for and twice the client's timeout: the trainer gets the other part,
    `partial` set, delivered once."""
    targets, frozen, on = behind_a_proxy(start_server, tmp_path)

    def freeze(step: Any) -> None:
        if isinstance(step, list) and any(call.method == "_hold" for call in step):
            frozen.hold()

    ask = {"num_groups": 8, "max_batches": 1, "delivery": "consume", "timeout": 1.0}
    out: list[Any] = []
    sampling = threading.Thread(target=lambda: out.extend(samples(kind, targets, [ask], freeze)), daemon=True)
    sampling.start()
    sampling.join(120)
    frozen.release()
    assert not sampling.is_alive(), "the sample waited for a shard that said nothing"
    (([batch], _),) = out
    assert batch.shards == ["free"] and batch.partial and len(batch.uids) == on["free"]
    with BufferClient(targets["free"]) as one:
        assert one.stats("t")["t"].consumed == on["free"]
    frozen.close()


def test_an_asyncio_sample_cancelled_as_its_parts_come_in_gives_back_those_it_holds(
    start_server: Servers, tmp_path: Path
) -> None:
    """A trainer's asyncio.wait_for cancels a sharded sample while one shard is slow to hand over its
    part: the other shard's part, taken and held, stayed held (invisible to every trainer, its
    stream open) until the client closed or the shard's max_confirm_seconds. It goes back as the
    call ends."""
    targets, slow, on = behind_a_proxy(start_server, tmp_path)
    ready = on["free"]

    async def cancelled() -> None:
        async with AsyncShardedBufferClient(targets, timeout=5.0) as client:
            driven = client._step

            async def step(step: Any) -> Any:
                if isinstance(step, list) and any(call.method == "_hold" for call in step):
                    slow.delay = 2.0  # the full shard turns slow after its ready probe
                return await driven(step)

            client._step = step  # type: ignore[method-assign]
            batches = client.sample("t", num_groups=8, timeout=5.0, max_batches=1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(anext(batches), 1.0)
            await batches.aclose()
            with BufferClient(targets["free"]) as one:
                stats = one.stats("t")["t"]
            assert (stats.ready, stats.leased, stats.sampled) == (ready, 0, 0), stats

    asyncio.run(cancelled())
    slow.close()


@pytest.mark.parametrize("delivery", ["consume", "lease"])
def test_an_asyncio_sample_cancelled_as_its_parts_are_confirmed_loses_no_batch(
    start_server: Servers, tmp_path: Path, delivery: str
) -> None:
    """A cancel that lands as a sharded batch's held parts are confirmed (a trainer's wait_for running
    out just then) cut the confirmations' step: the shards consumed or leased the parts, and the
    caller got CancelledError and no batch, the parts given back to no one (an audit: 16 of 16
    experiences gone with consume; with lease, held until the lease expired). The step runs to its
    end: a consumed batch, which nothing can put back, is handed over (the cancelled await returns
    it); a leased one is handed back and the cancel goes on."""
    targets, _ = in_process_shards(start_server, tmp_path)
    with ShardedBufferClient(targets, timeout=5.0) as admin:
        admin.create_table("t", group_size=2, estimator="none")
        admin.push(groups(0, range(8), range(2)), table="t")

    async def cancelled() -> Any:
        async with AsyncShardedBufferClient(targets, timeout=5.0) as client:
            made = client._call

            async def call(call: Any) -> Any:
                if call.method == "deliver":  # the caller gives up as the confirmation goes
                    asyncio.get_running_loop().call_soon(sampling.cancel)
                return await made(call)

            client._call = call  # type: ignore[method-assign]

            async def first() -> Any:
                async for batch in client.sample("t", num_groups=8, timeout=10.0, delivery=delivery):
                    return batch
                raise AssertionError("no batch")

            sampling = asyncio.ensure_future(first())
            try:
                return await sampling
            except asyncio.CancelledError:
                return None

    handed = asyncio.run(cancelled())
    with ShardedBufferClient(targets, timeout=5.0) as admin:
        left = sorted(uid for batch in drain(admin, "t", 8) for uid in batch.uids)
    every = sorted(item.eid.uid for item in groups(0, range(8), range(2)))
    if delivery == "consume":
        assert handed is not None and sorted(handed.uids) == every and left == []
    else:
        assert handed is None and left == every


@pytest.mark.parametrize("leaves", [False, True], ids=["reads-on", "breaks-out"])
def test_a_task_cancelled_as_its_sharded_batch_is_confirmed_is_handed_it_then_cancelled(
    start_server: Servers, tmp_path: Path, leaves: bool
) -> None:
    """The consumed batch a cancelled await is handed (above) held the cancel back for good: a task
    cancelled there (`task.cancel()`, a trainer's shutdown) went on with its stream, consuming all
    there was and waiting for more. The cancel is raised at the task's next step of the stream, or
    where the task leaves the stream with that batch (`break`), as the stream ends."""
    targets, _ = in_process_shards(start_server, tmp_path)
    with ShardedBufferClient(targets, timeout=5.0) as admin:
        admin.create_table("t", group_size=2, estimator="none")
        admin.push(groups(0, range(8), range(2)), table="t")

    async def cancelled() -> tuple[list[Any], bool]:
        had: list[Any] = []
        async with AsyncShardedBufferClient(targets, timeout=5.0) as client:
            made = client._call

            async def call(call: Any) -> Any:
                if call.method == "deliver" and not had:  # the first batch's confirmation goes as the cancel lands
                    asyncio.get_running_loop().call_soon(training.cancel)
                return await made(call)

            client._call = call  # type: ignore[method-assign]

            async def train() -> None:
                async for batch in client.sample("t", num_groups=2, timeout=10.0, delivery="consume"):
                    had.append(batch)
                    if leaves:
                        break
                await asyncio.sleep(30)  # its work after the stream

            training = asyncio.ensure_future(train())
            done, _ = await asyncio.wait([training], timeout=20)
            return had, bool(done) and training.cancelled()

    had, ended = asyncio.run(cancelled())
    assert ended and len(had) == 1
    with ShardedBufferClient(targets, timeout=5.0) as admin:
        left = sorted(uid for batch in drain(admin, "t", 8) for uid in batch.uids)
    every = sorted(item.eid.uid for item in groups(0, range(8), range(2)))
    assert sorted([*had[0].uids, *left]) == every


def test_a_sharded_client_closed_under_calls_in_flight_cancels_them(start_server: Servers, tmp_path: Path) -> None:
    """A sharded client closed while a call waits on a shard that says nothing (a frozen process)
    waited for the call to reach its deadline (its thread pool shut down first, waiting for what ran
    on it, then the channels closed): a trainer's shutdown hung that long. As one server's client
    does, the close cancels the calls in flight (CANCELLED), and a call made on the closed client is
    refused CANCELLED, not a RuntimeError of its thread pool (an audit)."""
    targets, frozen, _ = behind_a_proxy(start_server, tmp_path)
    client = ShardedBufferClient(targets, timeout=20.0)
    client.shard_stats("t")  # connected
    frozen.hold()
    out: list[Any] = []

    def push() -> None:
        try:
            out.append(client.push(groups(1, range(8), range(2)), table="t"))
        except ExpbufError as exc:
            out.append(exc)

    calling = threading.Thread(target=push, daemon=True)
    calling.start()
    time.sleep(0.5)  # the call on its way to the frozen shard
    closing = threading.Thread(target=client.close, daemon=True)
    closing.start()
    closing.join(10)
    calling.join(10)
    frozen.release()
    frozen.close()
    assert not closing.is_alive() and not calling.is_alive(), "the close waited for the call's deadline"
    (error,) = out
    assert isinstance(error, ExpbufError) and error.code == grpc.StatusCode.CANCELLED, error
    with pytest.raises(ExpbufError, match="closed") as refused:
        client.push(groups(2, range(8), range(2)), table="t")
    assert refused.value.code == grpc.StatusCode.CANCELLED
