"""The clients' error types and the asyncio batch's coroutine methods, against a real server."""

from __future__ import annotations

import asyncio
import inspect
import pickle
from collections.abc import Callable

import grpc
import pytest

from expbuf.client import (
    AlreadyExistsError,
    AsyncBufferClient,
    BufferClient,
    BufferError,
    DataLossError,
    DeadlineExceededError,
    ExpbufError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from expbuf.client.client import AsyncBatch
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient
from expbuf.client.shards.common import ShardError

from conftest import BAD_DIR, payload


def test_each_status_a_caller_handles_has_its_type(target: str) -> None:
    with BufferClient(target, retries=0) as client:
        client.create_table("g", group_size=8)
        client.push(payload("grpo_group.trxp"), table="g")
        cases = [
            (lambda: client.push((BAD_DIR / "bad_magic.bin").read_bytes()), InvalidArgumentError),
            (lambda: client.stats("nope"), NotFoundError),
            (lambda: client.create_table("g", group_size=4), AlreadyExistsError),
            (
                lambda: next(client.sample("default", num_groups=1, timeout=0.2, delivery="consume")),
                DeadlineExceededError,
            ),
        ]
        for call, kind in cases:
            with pytest.raises(kind) as raised:
                call()
            error = raised.value
            assert type(error) is kind and error.code == kind.status and error.details
            assert isinstance(error, ExpbufError) and isinstance(error, BufferError)  # the old name still catches
            back = pickle.loads(pickle.dumps(error))  # crosses processes (Ray, multiprocessing) intact
            assert type(back) is kind and (back.code, back.details) == (error.code, error.details)
    assert type(ExpbufError(grpc.StatusCode.FAILED_PRECONDITION, "x")) is FailedPreconditionError
    assert type(ExpbufError(grpc.StatusCode.DATA_LOSS, "x")) is DataLossError
    assert type(ExpbufError(grpc.StatusCode.ABORTED, "x")) is ExpbufError  # no subclass: the base


def test_async_batch_ack_is_a_coroutine_function(target: str) -> None:
    async def run() -> dict:
        async with AsyncBufferClient(target) as client:
            await client.push(payload("grpo_group.trxp"))
            async for batch in client.sample(num_groups=1, delivery="lease", max_batches=1, timeout=10):
                assert isinstance(batch, AsyncBatch) and inspect.iscoroutinefunction(batch.ack)
                assert inspect.iscoroutinefunction(batch.nack)
                assert await batch.ack() == len(batch.uids)
            return (await client.stats())["default"]

    stats = asyncio.run(run())
    assert stats.leased == 0 and stats.consumed == 8


BAD_SAMPLE_OPTIONS = [
    ({}, "exactly one of batch_size"),
    ({"num_groups": 1, "batch_size": 8}, "exactly one of batch_size"),
    ({"num_groups": -1}, "num_groups is -1"),
    ({"batch_size": 2.5}, "batch_size is 2.5"),
    ({"num_groups": 1, "order": ""}, "order is ''; expected one of fifo"),
    ({"num_groups": 1, "delivery": "once"}, "delivery is 'once'; expected one of consume, lease, replay"),
    ({"num_groups": 1, "lease_seconds": 0}, "lease_seconds is 0"),
    ({"num_groups": 1, "timeout": float("nan")}, "timeout is nan"),
    ({"num_groups": 1, "max_batches": -2}, "max_batches is -2"),
    ({"num_groups": 1, "trainer_version": -1}, "trainer_version is -1"),
    ({"num_groups": 1, "allow_partial": "yes"}, "allow_partial is 'yes'"),
    ({"num_groups": 1, "window": 9}, "window is 9; it must be 1 to 8"),
    ({"num_groups": 1, "prefetch": -1}, "prefetch is -1"),
    ({"num_groups": 1, "window": 2, "prefetch": 3}, r"prefetch is 3; it must be 0 to window \(2\)"),
]


def test_every_client_refuses_a_bad_sample_option_by_name(target: str) -> None:
    """The four clients build one SampleSpec: the same refusal, naming the option, before any stream opens."""

    async def run_async(make: Callable[[], AsyncBufferClient | AsyncShardedBufferClient]) -> None:
        async with make() as client:
            for options, message in BAD_SAMPLE_OPTIONS:
                with pytest.raises(ValueError, match=message):
                    await anext(client.sample("g", **options))

    with BufferClient(target) as client, ShardedBufferClient([target]) as sharded:
        client.create_table("g", group_size=8)
        client.push(payload("grpo_group.trxp"), table="g")
        for options, message in BAD_SAMPLE_OPTIONS:
            for each in (client, sharded):
                with pytest.raises(ValueError, match=message):
                    next(each.sample("g", **options))
        asyncio.run(run_async(lambda: AsyncBufferClient(target)))
        asyncio.run(run_async(lambda: AsyncShardedBufferClient([target])))
        stats = client.stats("g")["g"]
        assert stats.pushed == 8 and stats.sampled == stats.consumed == stats.leased == 0  # none taken


NAMED_PARAMS = (
    "std_cal_level: group or batch; opmd_baseline: mean or logavgexp; enable_step_norm: false or true;"
    " std_normalize: false or true"
)
BAD_TABLE_SETTINGS = [
    ({"shaping": {"reward_running_norm": "yes"}}, "shaping reward_running_norm is 'yes'; allowed: true or false"),
    ({"shaping": {"reward_clip": "5"}}, "shaping reward_clip is '5'; allowed: a number within a double's range"),
    ({"group_size": -1}, "group_size is -1; allowed: an integer >= 0 (at most 2^32 - 1)"),
    ({"capacity_experiences": 2.5}, "capacity_experiences is 2.5; allowed: an integer >= 0 (at most 2^64 - 1)"),
    ({"drop_zero_variance": "no"}, "drop_zero_variance is 'no'; allowed: true or false"),
    (
        {"estimator": "rec", "estimator_params": {"drop": "balance"}},
        f"estimator parameter drop is 'balance'; allowed: a number (names are taken by {NAMED_PARAMS})",
    ),
    (
        {"estimator_params": {"std_cal_level": "row"}},
        "estimator parameter std_cal_level is 'row'; allowed: group or batch",
    ),
    ({"estimator_params": {"epsilon": [1]}}, "estimator parameter epsilon is [1]; allowed: a number"),
    ({"estimator": 5}, "estimator is 5; allowed: an estimator's name"),
    ({"device": None}, "device is None; allowed: a device's name (auto, cpu or cuda)"),
]


def test_a_bad_table_setting_is_refused_by_the_client_naming_it_and_what_it_allows(target: str) -> None:
    """Caught before the call (the wire cannot carry the value): each names the setting, its value
    and the values it takes, and creates nothing."""
    with BufferClient(target) as client:
        for settings, message in BAD_TABLE_SETTINGS:
            with pytest.raises(ValueError) as info:
                client.create_table("t", **settings)
            assert str(info.value) == message
        assert [table.name for table in client.list_tables()] == ["default"]


def every_error_class() -> list[type[ExpbufError]]:
    """ExpbufError and every class below it, the sharded clients' ShardError among them."""
    found, todo = [], [ExpbufError]
    while todo:
        kind = todo.pop()
        found.append(kind)
        todo.extend(kind.__subclasses__())
    return found


def made(kind: type[ExpbufError]) -> ExpbufError:
    """An error of `kind` as a client raises one: its status, details, reason and the attributes
    some callers read (busy, uids; a ShardError's shards and result)."""
    code = kind.status or grpc.StatusCode.ABORTED
    if kind is ShardError:
        error: ExpbufError = ShardError(code, "shard s1 refused", ["s1"], {"s0": 3}, reason="forbidden")
    else:
        error = kind(code, f"{kind.__name__} details", "table_full")
    error.busy = True
    error.uids = ("u1", "u2")
    return error


@pytest.mark.parametrize("kind", every_error_class(), ids=lambda kind: kind.__name__)
def test_every_error_survives_a_pickle_round_trip_and_ray_s_cause_class(kind: type[ExpbufError]) -> None:
    """Ray carries a task's exception to its caller pickled, and raises it as a class that is
    both RayTaskError and the exception's own: both need the error's type, code and details
    (`except UnavailableError` in a driver, around an actor's call)."""
    error = made(kind)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is kind
    assert (back.code, back.details, back.reason, back.busy, back.uids) == (
        error.code, error.details, error.reason, True, ("u1", "u2")
    )  # fmt: skip
    assert str(back) == str(error) and back.args == error.args
    if isinstance(error, ShardError):
        assert isinstance(back, ShardError) and (back.shards, back.result) == (["s1"], {"s0": 3})
    exceptions = pytest.importorskip("ray.exceptions")
    raised = exceptions.RayTaskError("put", "Traceback ...", back).as_instanceof_cause()
    assert isinstance(raised, kind) and isinstance(raised, exceptions.RayTaskError)
    assert (raised.code, raised.details) == (error.code, error.details)


def test_numpy_scalars_are_taken_as_the_python_values_they_hold(target: str) -> None:
    """Settings read from a config a trainer built with numpy (np.True_, np.int64, np.float32) are
    its bools and numbers: a numpy bool was refused as 'np.True_; allowed: true or false'."""
    np = pytest.importorskip("numpy")
    with BufferClient(target) as client:
        made = client.create_table(
            "n",
            group_size=np.int64(4),
            drop_zero_variance=np.True_,
            group_timeout_seconds=np.float32(1.5),
            estimator="rec",
            estimator_params={"std_normalize": np.False_, "epsilon": np.float64(1e-5)},
            shaping={"reward_running_norm": np.bool_(True)},
        )
        (config,) = [table for table in client.list_tables() if table.name == "n"]
    assert config == made
    assert (config.group_size, config.drop_zero_variance, config.group_timeout_seconds) == (4, True, 1.5)
    assert config.estimator_params["std_normalize"] == "false" and config.shaping.reward_running_norm is True


def test_a_claim_or_admit_whose_wait_is_not_a_finite_number_is_refused_naming_it(target: str) -> None:
    """wait=nan or inf made the call's deadline, which then failed DEADLINE_EXCEEDED at once ("after
    0.00s"), before the server could say what was wrong; the sharded client already refused them."""
    with BufferClient(target) as client:
        client.create_table("w", group_size=2, estimator="none", max_staleness=1, batch_size=1)
        client.create_dataset("w", "d", 4)
        for wait in (float("nan"), float("inf"), -1, "1"):
            with pytest.raises(ValueError, match=r"^claim: wait is .*; it is a finite number of seconds, 0 or more$"):
                client.claim("w", "d", 1, wait=wait)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"^admit: wait is .*; it is a finite number of seconds, 0 or more$"):
                client.admit("w", 1, wait=wait)  # type: ignore[arg-type]
        assert client.ledger("w", "d").total("claimed") == 0 and client.stats("w")["w"].submitted == 0
