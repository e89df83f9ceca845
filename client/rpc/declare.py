"""A call of the service declared once for the four clients (BufferClient, AsyncBufferClient and
the two sharded clients): its name, parameters, defaults and docstring, what it sends and how its
reply is read, and how the sharded clients route it.

A declaration is a method of a class the clients inherit (rpc/api.py), written as the call's plan
for one server: it returns the call to make (a `Unary`, a push in `Chunked`, `Several` made in
turn), or it is a generator that yields the calls to make and is sent their results (`Steps`: a
call that pages on, or asks once per dataset). `declare` makes it a `Declared`, a descriptor that
gives each client class the method of its kind (its `Runner`): BufferClient's makes the plan's
calls and waits for each (`Blocking`), AsyncBufferClient's is a coroutine function that awaits
them (`Awaiting`), and a sharded client's runs the call's route over the shards (`shards=`,
declared with the call: a plan of shards/, given the call's arguments bound to its parameters,
defaults applied). Each method has the declaration's name, docstring and signature, its result
the plan's; mypy reads it from `Declared.__get__`'s overloads: the declaration's parameters, and
its result (a coroutine of it for an asyncio client).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import warnings
from collections.abc import Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from .connection import RETRIED_METHODS
from .wire import REPEATS_ANSWERED

if TYPE_CHECKING:
    from ..shards.routes import ShardPlans

# The annotations (as written: postponed) of a declared call's parameters that take names.
NAMES = frozenset({"Iterable[str]", "Sequence[str]"})
_DEFAULT = object()  # an argument not given: its parameter's default
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T")
Y = TypeVar("Y")


@dataclass(frozen=True)
class Unary(Generic[R]):
    """One unary call: `method` of the stub with `request`; `read` turns the reply into the result.

    `retry` says whether the call may be made again after UNAVAILABLE (it is idempotent); a
    call of a method under the channel's retry policy (connection.RETRIED_METHODS) that may not
    goes over the client's channel without it. `timeout` replaces the client's deadline for this
    call. `parts`: the method answers with a stream of SampleReply (ReadFields), one reply in one
    message or in parts (sample_reply.Parts), which `read` gets put together. `fallback`: the call
    made instead where the server has no such method (an older server: UNIMPLEMENTED).
    `remembered`: made again, the call is answered as the first only by a server that remembers it
    (wire.REPEATS_ANSWERED), so it is retried only where its server says it does (calls/repeats.py).
    """

    method: str
    request: Any
    read: Callable[[Any], R]
    retry: bool
    timeout: float | None = None
    parts: bool = False
    fallback: Unary[R] | None = None
    remembered: bool = False

    def __post_init__(self) -> None:
        if self.retry and self.method not in RETRIED_METHODS:
            raise ValueError(f"{self.method} is not under the channel's retry policy (connection.RETRIED_METHODS)")
        if self.remembered and self.method not in REPEATS_ANSWERED:
            raise ValueError(f"{self.method} is not among the calls a server answers again (wire.REPEATS_ANSWERED)")

    @property
    def message_bytes(self) -> int | None:
        """What the call declares of its message (wire.MESSAGE_BYTES): a request written by hand
        (frames.py: a Push's, a PutValues') its own size; None for the others."""
        return len(self.request) if isinstance(self.request, bytes) else None


@dataclass(frozen=True)
class Chunked(Generic[R]):
    """A push sent in chunks over PushStream (PushRequest.total_bytes): `requests()` makes its
    messages (serialised, frames.py) as gRPC sends them, which it keeps for a retry; the stream's one
    reply is read as a Unary's, and a retry sends the whole push again, as a push sent whole.
    `message_bytes`: the most one of its messages takes (a chunk's, frames.most_push_request),
    which it declares (wire.MESSAGE_BYTES)."""

    requests: Callable[[], Iterator[bytes]]
    read: Callable[[Any], R]
    retry: bool
    timeout: float | None = None
    method: str = "PushStream"
    message_bytes: int | None = None


@dataclass(frozen=True)
class Several(Generic[R, T]):
    """A call made as several: one naming more than a call may carry (client/schema/call_limits.py),
    each part a call of its own, made in turn; `joined` makes their results one."""

    calls: list[Unary[R]]
    joined: Callable[[list[R]], T]


Step = Unary[Any] | Chunked[Any]
# A plan that asks for its calls in turn: each result is sent back into it.
Steps = Generator[Step, Any, T]
# What a declaration returns: the call to make, several, or its steps.
Plan = Unary[T] | Chunked[T] | Several[Any, T] | Steps[T]
# A call's route over shards: the sharded clients' plan of it (shards/plans.py), of their planner.
Route = Callable[["ShardPlans"], Callable[..., Generator[Any, Any, S]]]


def waited(call: str, wait: object) -> float:
    """A call's `wait`, seconds it may wait at the server beside its deadline's: a number 0 or more
    and finite, or a ValueError naming it (NaN or infinity made its deadline, and it failed
    DEADLINE_EXCEEDED at once, before the server could say what was wrong)."""
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < math.inf:
        raise ValueError(f"{call}: wait is {wait!r}; it is a finite number of seconds, 0 or more")
    return wait


def steps(plan: Plan[T]) -> Steps[T]:
    """The calls of a plan in turn: one call, Several's, or the plan's own steps."""
    if isinstance(plan, Generator):
        return plan
    if isinstance(plan, Several):
        return _several(plan)
    return _one(plan)


def _one(call: Unary[T] | Chunked[T]) -> Steps[T]:
    result: T = yield call
    return result


def _several(several: Several[Any, T]) -> Steps[T]:
    results = []
    for call in several.calls:
        results.append((yield call))
    return several.joined(results)


class Turns(Generic[Y, T]):
    """A plan's steps in turn, for a client's loop over them: the outcome of each step (`answer`,
    None unanswered) is sent back into the plan for the next, and `result` is the plan's once the
    loop has ended. The same loop drives a plan blocking or awaiting, one server's or shards'."""

    def __init__(self, plan: Generator[Y, Any, T]) -> None:
        self._plan = plan
        self._outcome: Any = None
        self.result: T

    def __iter__(self) -> Iterator[Y]:
        return self

    def __next__(self) -> Y:
        outcome, self._outcome = self._outcome, None
        try:
            return self._plan.send(outcome)
        except StopIteration as done:
            self.result = done.value
            raise StopIteration from None

    def answer(self, outcome: Any) -> None:
        self._outcome = outcome


class ClientSettings:
    """What a declaration reads of the client of one server that makes its call (set by
    rpc/connection.ClientBase): its deadline, its largest message, its push chunks."""

    timeout: float
    max_message_bytes: int
    push_chunk_bytes: int


class Runner:
    """How a client makes the calls declared for it: `_adapt` makes a declaration its method."""

    @classmethod
    def _adapt(cls, call: Declared[Any, Any, Any]) -> Callable[..., Any]:
        raise NotImplementedError


class Blocking(Runner):
    """A client of one server that waits for each call (BufferClient)."""

    def _perform(self, plan: Plan[T]) -> T:
        """The plan's result, its calls made in turn."""
        raise NotImplementedError

    @classmethod
    def _adapt(cls, call: Declared[Any, Any, Any]) -> Callable[..., Any]:
        def method(self: Blocking, /, *args: Any, **kwargs: Any) -> Any:
            call.check(args, kwargs)
            return self._perform(call.plan(self, *args, **kwargs))

        return method


class Awaiting(Runner):
    """A client of one server whose calls are coroutines (AsyncBufferClient)."""

    async def _perform(self, plan: Plan[T]) -> T:
        """The plan's result, its calls made in turn."""
        raise NotImplementedError

    @classmethod
    def _adapt(cls, call: Declared[Any, Any, Any]) -> Callable[..., Any]:
        async def method(self: Awaiting, /, *args: Any, **kwargs: Any) -> Any:
            call.check(args, kwargs)
            return await self._perform(call.plan(self, *args, **kwargs))

        return method


class BlockingShards(Runner):
    """A client of many shards that waits for each call (ShardedBufferClient)."""

    def _run(self, plan: Generator[Any, Any, T]) -> T:
        """The result of a plan over the shards."""
        raise NotImplementedError

    @classmethod
    def _adapt(cls, call: Declared[Any, Any, Any]) -> Callable[..., Any]:
        def method(self: BlockingShards, /, *args: Any, **kwargs: Any) -> Any:
            return self._run(call.routed(self, args, kwargs))

        return method


class AwaitingShards(Runner):
    """A client of many shards whose calls are coroutines (AsyncShardedBufferClient)."""

    async def _run(self, plan: Generator[Any, Any, T]) -> T:
        """The result of a plan over the shards."""
        raise NotImplementedError

    @classmethod
    def _adapt(cls, call: Declared[Any, Any, Any]) -> Callable[..., Any]:
        async def method(self: AwaitingShards, /, *args: Any, **kwargs: Any) -> Any:
            return await self._run(call.routed(self, args, kwargs))

        return method


class Declared(Generic[P, T, S]):
    """A declared call: its plan for one server, its route over shards (None: one server's only),
    and the method made of them for each client class that reads it."""

    def __init__(self, plan: Callable[Concatenate[Any, P], Plan[T]], route: Route[S] | None) -> None:
        if not plan.__doc__:
            raise TypeError(f"{plan.__qualname__}: a declared call says what it does (its docstring)")
        self.plan, self.route, self.name, self.__doc__ = plan, route, plan.__name__, plan.__doc__
        self.signature = inspect.signature(plan)
        self._methods: dict[type, Callable[..., Any]] = {}
        # The parameters that take names (a list of uids, fields, keys, ...) and the table's, each
        # with its place among the arguments after the client's own (None: by keyword only).
        params = list(self.signature.parameters.values())[1:]
        self._typed = [
            (param.name, at if param.kind is param.POSITIONAL_OR_KEYWORD else None, param.annotation in NAMES)
            for at, param in enumerate(params)
            if param.annotation in NAMES or (param.name == "table" and param.annotation == "str")
        ]

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse a str (or bytes) given for names, which the call would read as its characters (a
        uid "a/0/1/0/" as 8 one-letter uids), and a table that is not a str (None read the default
        table): a TypeError naming the call and its parameter."""
        for name, at, names in self._typed:
            value = args[at] if at is not None and at < len(args) else kwargs.get(name, _DEFAULT)
            if value is _DEFAULT:
                continue
            if names and isinstance(value, str | bytes):
                raise TypeError(f"{self.name}: {name} must be a list (or other iterable) of str, not one {value!r}")
            if not names and not isinstance(value, str):
                raise TypeError(f"{self.name}: table must be a str, not {value!r}")

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: Blocking, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: Awaiting, owner: type | None = None) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, obj: BlockingShards, owner: type | None = None) -> Callable[P, S]: ...
    @overload
    def __get__(self, obj: AwaitingShards, owner: type | None = None) -> Callable[P, Coroutine[Any, Any, S]]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        kind = type(obj) if owner is None else owner
        if not issubclass(kind, Runner):  # the declaring class's own: the declaration
            return self
        method = self._methods.get(kind) or self._made(kind)
        return method if obj is None else MethodType(method, obj)

    def _made(self, kind: type[Runner]) -> Callable[..., Any]:
        """The method of client class `kind`, named, documented and signed as declared."""
        sharded = issubclass(kind, BlockingShards | AwaitingShards)
        if sharded and self.route is None:
            raise TypeError(f"{self.name} has no route over shards: a sharded client has no such call")
        method: Any = kind._adapt(self)
        method.__name__, method.__qualname__ = self.name, f"{kind.__qualname__}.{self.name}"
        method.__module__, method.__doc__ = self.plan.__module__, self.__doc__
        result = _result(self.signature.return_annotation)
        if sharded and self.route is not None:  # the route's own, where it differs (reset_offpolicy)
            result = _result(inspect.signature(self.route(kind)).return_annotation) or result  # type: ignore[arg-type]
        method.__signature__ = self.signature.replace(return_annotation=result or inspect.Signature.empty)
        self._methods[kind] = method
        return method

    def routed(self, client: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Generator[Any, Any, S]:
        """The route's plan of the call with these arguments, each passed by its parameter's name
        (the defaults applied here, so a route states none of its own)."""
        assert self.route is not None
        self.check(args, kwargs)
        bound = self.signature.bind(client, *args, **kwargs)
        bound.apply_defaults()
        _, *arguments = bound.arguments.items()  # the client's own first
        return self.route(client)(**dict(arguments))


def declare(
    shards: Route[S] | None = None,
) -> Callable[[Callable[Concatenate[Any, P], Plan[T]]], Declared[P, T, S]]:
    """Declare the decorated method a call of the clients, routed over shards by `shards` (a
    function of the sharded clients' planner that gives the plan of the call: `lambda s:
    s._fail_runs`); without it, the call is one server's only."""

    def declared(plan: Callable[Concatenate[Any, P], Plan[T]]) -> Declared[P, T, S]:
        return Declared(plan, shards)

    return declared


def declared_calls(kind: type) -> dict[str, Declared[Any, Any, Any]]:
    """The calls declared for a client class, by name, in the order their classes declare them."""
    found = {name: value for base in reversed(kind.__mro__) for name, value in vars(base).items()}
    return {name: value for name, value in found.items() if isinstance(value, Declared)}


def _result(annotation: Any) -> str:
    """The result a plan's annotation names: X of "Plan[X]" or "Steps[X]" ("" for another)."""
    if not isinstance(annotation, str) or not annotation.endswith("]"):
        return ""
    name, _, inner = annotation[:-1].partition("[")
    return inner if name in ("Plan", "Steps") else ""


_CLIENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_caller(message: str, category: type[Warning]) -> None:
    """Warn, attributed to the line that made the call: the first frame outside the client, however
    many of the client's own (its method, its runner, the plan) stand between."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_CLIENT):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
