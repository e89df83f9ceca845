"""Names of the wire enums and table settings, shared by the client and the server, and the
constants of the wire both write: metadata keys, a SampleReply's tags.

Table settings travel as plain dicts with the names of the TOML file and of
`BufferClient.create_table`; these functions turn them into the proto message and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2

from expbuf.proto.v1 import buffer_pb2 as pb

from ..schema.orders import order_problem
from ..schema.reasons import DOMAIN, Reason
from ..schema.table_settings import PARAM_CHOICES, SETTING_NAMES, SHAPING_NAMES
from ..trxp.codec.convert import python_number

GROUP_BY = {"task": pb.GROUP_BY_TASK, "run": pb.GROUP_BY_RUN, "step": pb.GROUP_BY_STEP, "none": pb.GROUP_BY_NONE}
WHEN_FULL = {"block": pb.WHEN_FULL_BLOCK, "evict": pb.WHEN_FULL_EVICT}
ON_GROUP_TIMEOUT = {"release": pb.ON_GROUP_TIMEOUT_RELEASE, "drop": pb.ON_GROUP_TIMEOUT_DROP}
ON_STALE = {"drop": pb.ON_STALE_DROP, "refuse": pb.ON_STALE_REFUSE}
ON_TOKEN_STALE = {"mask": pb.ON_TOKEN_STALE_MASK, "drop": pb.ON_TOKEN_STALE_DROP}
COMPRESSION = {"none": pb.COMPRESSION_NONE, "zstd": pb.COMPRESSION_ZSTD}
ORDER = {"fifo": pb.ORDER_FIFO, "lifo": pb.ORDER_LIFO, "uniform": pb.ORDER_UNIFORM, "priority": pb.ORDER_PRIORITY}
DELIVERY = {"consume": pb.DELIVERY_CONSUME, "lease": pb.DELIVERY_LEASE, "replay": pb.DELIVERY_REPLAY}
# The trailing metadata of a refusal of a call the server did not begin, because as many calls as
# it lets in were in progress (server/rpc/interceptors/limits.py): the same call later may get in.
BUSY = "expbuf-busy"
# The call metadata in which a Push, PushStream or PutValues declares the most a message of it will
# be, in bytes (its serialised size): the server reserves that much of max_inflight_bytes before it
# reads one, and refuses a larger one (server/rpc/push/push_memory.py). A call without it is read as before.
MESSAGE_BYTES = "expbuf-message-bytes"
# The least chunk of a push a client sends (push_chunk_bytes): the least max_message_bytes a server
# takes, so that a client can always be made whose chunks fit the server's messages.
LEAST_CHUNK_BYTES = 1 << 16
# The calls a server answers, made again after their reply was lost, as it answered the first, from
# what it remembers of them (ServerInfoReply.repeats_answered): the clients retry one only where its
# server names it (calls/repeats.py). Made again on a server that does not, a claim claims again,
# an admit grants again and a writer's open or close counts twice.
REPEATS_ANSWERED = ("Ack", "Admit", "Claim", "FinishGrant", "Nack", "Writers")
# Where gRPC's rich error model carries a status's details (a google.rpc.Status, serialised).
STATUS_DETAILS = "grpc-status-details-bin"
# A SampleReply's bytes, which the server writes by hand (server/rpc/sample/replies.py) and the
# client reads in place (sample_reply.py): the tag protobuf writes before each field written so (its
# number and wire type, one byte), and where a column's values start.
PAYLOAD_TAG = 0x0A  # SampleReply field 1 (payload), length-delimited
COLUMN_TAG = 0x62  # SampleReply field 12 (columns), length-delimited
PART_TAG = 0x6A  # SampleReply field 13 (part), length-delimited
WHOLE_TAG = 0x70  # SampleReply field 14 (whole_bytes), varint
VALUES_TAG = 0x32  # Column field 6 (values), length-delimited
ALIGN_TAG = 0x3A  # Column field 7 (align: zeros before the values), length-delimited
ALIGN = 64  # each column's values start at a multiple of this from the reply's start


def refusal_trailer(code: int, message: str, reason: Reason, busy: bool = False) -> tuple[tuple[str, Any], ...]:
    """The trailing metadata of a refusal: its reason as a google.rpc.ErrorInfo of domain `expbuf`
    in the status details, which any gRPC client can read, and BUSY where the call did nothing."""
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN))
    trailer: tuple[tuple[str, Any], ...] = ((STATUS_DETAILS, status.SerializeToString()),)
    return (*trailer, (BUSY, "1")) if busy else trailer


def reason_of(trailing: Any) -> str | None:
    """The reason an expbuf server gave a refusal, from the call's trailing metadata (pairs, as the
    blocking and the asyncio calls give them); None from a server that sent none (an older one,
    or a proxy that refused the call itself)."""
    for key, value in trailing or ():
        if key != STATUS_DETAILS or not isinstance(value, bytes):
            continue
        try:
            details = status_pb2.Status.FromString(value).details
        except DecodeError:
            return None
        info = error_details_pb2.ErrorInfo()
        for detail in details:
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN:
                return info.reason
    return None


def param_number(name: str, value: Any) -> Any:
    """An estimator parameter as the wire carries it: a number as it is (a flag as 0 or 1, or
    False or True), a choice by its position. The server checks the number against the
    estimator's range. A bool is a flag's only: given for a number, it was read as 0 or 1."""
    choices = PARAM_CHOICES.get(name, ())
    value = python_number(value)  # a config built with numpy: np.True_ for a flag
    if isinstance(value, bool) and choices == _FLAG:
        return float(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise WireError(
                f"estimator parameter {name} is {_shown(value)}; allowed: a number within a double's range"
            ) from None
    if isinstance(value, str) and value in choices:
        return float(choices.index(value))
    named = "; ".join(f"{param}: {' or '.join(names)}" for param, names in PARAM_CHOICES.items())
    allowed = " or ".join(choices) if choices else "a number"
    if isinstance(value, str) and not choices:
        allowed += f" (names are taken by {named})"
    raise WireError(f"estimator parameter {name} is {_shown(value)}; allowed: {allowed}")


_FLAG = ("false", "true")  # the choices of a flag, which a bool gives too


def _shown(value: Any) -> str:
    """A value in a refusal, cut short (an int of any size shown without its digits: str() of one of
    more than 4,300 refuses)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)[:40]


def param_value(name: str, number: float) -> Any:
    """An estimator parameter as the wire carried it (param_number), as it was given: a choice by
    its name, a number as it is."""
    choices = PARAM_CHOICES.get(name, ())
    return choices[int(number)] if choices and number in range(len(choices)) else number


# A table's off-policy settings (admission, staleness, rate limits): the trainer's side of a run.
OFF_POLICY_SETTINGS = (
    "max_staleness",
    "batch_size",
    "on_stale",
    "min_size_to_sample",
    "samples_per_insert",
    "samples_per_insert_error",
    "evict_stale",
    "max_token_staleness",
    "on_token_stale",
)
# Every setting of a table, by the names of the TOML file and of create_table.
TABLE_SETTINGS = ("name", *SETTING_NAMES)
# The settings of a table's `shaping` (reward shaping and advantage clipping).
SHAPING_SETTINGS = SHAPING_NAMES


class WireError(ValueError):
    """A message or a setting that the other side cannot take; the text names it."""


_Enum = TypeVar("_Enum", bound=int)  # a proto enum: its values are ints


def enum_value(mapping: Mapping[str, _Enum], what: str, name: str) -> _Enum:
    try:
        return mapping[name]
    except (KeyError, TypeError):
        raise WireError(f"{what} is {name!r}; expected one of {', '.join(mapping)}") from None


def order_fields(order: str) -> dict[str, Any]:
    """A sample request's order: a built-in one as the `order` enum, any other name of a
    registered order's form (an order registered on the server, which checks it) as `order_name`."""
    problem = order_problem(order)
    if problem is not None:
        raise WireError(problem)
    return {"order": ORDER[order]} if order in ORDER else {"order_name": order}


def enum_name(mapping: Mapping[str, int], what: str, value: int, default: str) -> str:
    """The name of an enum value; 0 (unspecified) is the default, an unknown value is refused."""
    if value == 0:
        return default
    for name, number in mapping.items():
        if number == value:
            return name
    raise WireError(f"{what} is {value}, not one of {', '.join(f'{n} ({v})' for n, v in mapping.items())}")


def shaping_to_proto(settings: dict[str, Any] | None) -> pb.Shaping:
    """A table's shaping settings -> Shaping message; an unknown setting is refused."""
    settings = settings or {}
    if not isinstance(settings, dict):
        raise WireError(f"shaping is {str(settings)[:40]!r}; expected a dict of settings")
    unknown = sorted(set(settings) - set(SHAPING_SETTINGS))
    if unknown:
        raise WireError(
            f"unknown shaping setting(s): {', '.join(u[:40] for u in unknown)}; known: {', '.join(SHAPING_SETTINGS)}"
        )
    return _message(pb.Shaping, "shaping ", settings)


def _message(cls: type[Message], what: str, fields: dict[str, Any]) -> Any:
    """A message of these fields; a value its field cannot take is refused naming the setting and
    the values its field takes. A bool is a true-or-false field's alone, and only a bool is: protobuf
    takes 1 for true and True for 1.0, so drop_zero_variance=1 was stored true and
    group_timeout_seconds=True as 1 second."""
    fields = {name: python_number(value) for name, value in fields.items()}  # a config built with numpy
    for name, value in fields.items():
        kind = cls.DESCRIPTOR.fields_by_name[name].type
        if value is not None and kind in _ALLOWED and (kind == FieldDescriptor.TYPE_BOOL) != isinstance(value, bool):
            raise WireError(f"{what}{name} is {_shown(value)}; allowed: {_ALLOWED[kind]}")
    try:
        return cls(**fields)
    except (TypeError, ValueError, OverflowError) as exc:
        for name, value in fields.items():
            try:
                cls(**{name: value})
            except (TypeError, ValueError, OverflowError):
                allowed = _ALLOWED.get(cls.DESCRIPTOR.fields_by_name[name].type, "a value of its type")
                raise WireError(f"{what}{name} is {_shown(value)}; allowed: {allowed}") from None
        raise WireError(f"{what.strip() or 'table'}: {str(exc)[:200]}") from None


# What a setting's field on the wire takes, by the field's type (the server checks the range it allows).
_ALLOWED = {
    FieldDescriptor.TYPE_BOOL: "true or false",
    FieldDescriptor.TYPE_DOUBLE: "a number within a double's range",
    FieldDescriptor.TYPE_UINT32: "an integer >= 0 (at most 2^32 - 1)",
    FieldDescriptor.TYPE_UINT64: "an integer >= 0 (at most 2^64 - 1)",
    FieldDescriptor.TYPE_INT64: "an integer",
    FieldDescriptor.TYPE_STRING: "a string",
}


def shaping_from_proto(msg: pb.Shaping) -> dict[str, Any]:
    """Shaping message -> shaping settings; an unset penalty factor keeps its default."""
    settings = {name: getattr(msg, name) for name in SHAPING_SETTINGS if name != "overlong_buffer_penalty_factor"}
    if msg.HasField("overlong_buffer_penalty_factor"):
        settings["overlong_buffer_penalty_factor"] = msg.overlong_buffer_penalty_factor
    return settings


def table_to_proto(settings: dict[str, Any]) -> pb.TableConfig:
    """Table settings (TOML names) -> TableConfig message; an unknown setting is refused."""
    unknown = sorted(set(settings) - set(TABLE_SETTINGS))
    if unknown:
        raise WireError(f"unknown table setting(s): {', '.join(unknown)}; known: {', '.join(TABLE_SETTINGS[1:])}")
    return _message(pb.TableConfig, "", dict(
        name=settings["name"],
        group_by=enum_value(GROUP_BY, "group_by", settings.get("group_by", "task")),
        group_size=settings.get("group_size", 0),
        group_timeout_seconds=settings.get("group_timeout_seconds", 0.0),
        on_group_timeout=enum_value(ON_GROUP_TIMEOUT, "on_group_timeout", settings.get("on_group_timeout", "release")),
        estimator=_estimator(settings),
        capacity_experiences=settings.get("capacity_experiences") or 0,
        capacity_bytes=settings.get("capacity_bytes") or 0,
        when_full=enum_value(WHEN_FULL, "when_full", settings.get("when_full", "block")),
        max_times_sampled=settings.get("max_times_sampled", 0),
        drop_zero_variance=settings.get("drop_zero_variance", False),
        tombstone_seconds=settings.get("tombstone_seconds"),
        keep_failed=settings.get("keep_failed"),
        shaping=shaping_to_proto(settings.get("shaping")),
        max_staleness=settings.get("max_staleness"),
        batch_size=settings.get("batch_size", 0),
        on_stale=enum_value(ON_STALE, "on_stale", settings.get("on_stale", "drop")),
        min_size_to_sample=settings.get("min_size_to_sample", 0),
        samples_per_insert=settings.get("samples_per_insert", 0.0),
        samples_per_insert_error=settings.get("samples_per_insert_error", 0.0),
        evict_stale=settings.get("evict_stale", False),
        priority_decay=settings.get("priority_decay", 0.0),
        reuse_cooldown_seconds=settings.get("reuse_cooldown_seconds", 0.0),
        priority_noise=settings.get("priority_noise", 0.0),
        extensions=_extensions(settings.get("extensions") or ()),
        min_group_size=settings.get("min_group_size", 0),
        max_token_staleness=settings.get("max_token_staleness"),
        on_token_stale=enum_value(ON_TOKEN_STALE, "on_token_stale", settings.get("on_token_stale", "mask")),
        # sent only where it compresses: a server that predates the setting refuses its field
        compression=None if settings.get("compression", "none") == "none" else enum_value(
            COMPRESSION, "compression", settings["compression"]
        ),
        compression_level=settings.get("compression_level"),
    ))  # fmt: skip


def _extensions(names: Any) -> list[str]:
    """The extension names a table runs: a list of names (a lone string would be its letters)."""
    if isinstance(names, str) or not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise WireError(f"extensions is {repr(names)[:40]}; allowed: a list of extension names")
    return list(names)


def _estimator(settings: dict[str, Any]) -> pb.Estimator:
    """The estimator, its parameters and its device, each refused by name when the wire cannot carry it."""
    name, device = settings.get("estimator", "grpo"), settings.get("device", "auto")
    params = settings.get("estimator_params") or {}
    if not isinstance(name, str):
        raise WireError(f"estimator is {repr(name)[:40]}; allowed: an estimator's name")
    if not isinstance(device, str):
        raise WireError(f"device is {repr(device)[:40]}; allowed: a device's name (auto, cpu or cuda)")
    if not isinstance(params, dict):
        raise WireError(f"estimator_params is {str(params)[:40]!r}; expected a dict of parameters")
    named = [key for key in params if not isinstance(key, str)]
    if named:
        raise WireError(f"estimator_params names a parameter {repr(named[0])[:40]}; a parameter's name is a str")
    return pb.Estimator(name=name, params={k: param_number(k, v) for k, v in params.items()}, device=device)


def table_from_proto(msg: pb.TableConfig) -> dict[str, Any]:
    """TableConfig message -> table settings (TOML names); unset enums take their defaults."""
    return {
        "name": msg.name,
        "group_by": enum_name(GROUP_BY, "group_by", msg.group_by, "task"),
        "group_size": msg.group_size,
        "group_timeout_seconds": msg.group_timeout_seconds,
        "on_group_timeout": enum_name(ON_GROUP_TIMEOUT, "on_group_timeout", msg.on_group_timeout, "release"),
        "estimator": msg.estimator.name or "grpo",
        "estimator_params": {name: param_value(name, value) for name, value in msg.estimator.params.items()},
        "device": msg.estimator.device or "auto",
        "capacity_experiences": msg.capacity_experiences,
        "capacity_bytes": msg.capacity_bytes,
        "when_full": enum_name(WHEN_FULL, "when_full", msg.when_full, "block"),
        "max_times_sampled": msg.max_times_sampled,
        "drop_zero_variance": msg.drop_zero_variance,
        **({"tombstone_seconds": msg.tombstone_seconds} if msg.HasField("tombstone_seconds") else {}),
        **({"keep_failed": msg.keep_failed} if msg.HasField("keep_failed") else {}),
        "shaping": shaping_from_proto(msg.shaping),
        "max_staleness": msg.max_staleness if msg.HasField("max_staleness") else None,
        "batch_size": msg.batch_size,
        "on_stale": enum_name(ON_STALE, "on_stale", msg.on_stale, "drop"),
        "min_size_to_sample": msg.min_size_to_sample,
        "samples_per_insert": msg.samples_per_insert,
        "samples_per_insert_error": msg.samples_per_insert_error,
        "evict_stale": msg.evict_stale,
        "priority_decay": msg.priority_decay,
        "reuse_cooldown_seconds": msg.reuse_cooldown_seconds,
        "priority_noise": msg.priority_noise,
        "extensions": list(msg.extensions),
        "min_group_size": msg.min_group_size,
        "max_token_staleness": msg.max_token_staleness if msg.HasField("max_token_staleness") else None,
        "on_token_stale": enum_name(ON_TOKEN_STALE, "on_token_stale", msg.on_token_stale, "mask"),
        "compression": enum_name(COMPRESSION, "compression", msg.compression, "none"),
        **({"compression_level": msg.compression_level} if msg.HasField("compression_level") else {}),
    }
