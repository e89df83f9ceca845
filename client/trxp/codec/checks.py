"""What later stages rely on, checked on every item: eids, numbers in range, metadata of
bounded shape and size, tensors consistent with the metadata. Messages name the item and
field and show at most MAX_SHOWN characters of any input (shown.py); the expansion bound's
measure of the metadata is measure.py's.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Final

from ...schema.experience import EID, EID_PARTS, RESPONSE_TENSOR_FIELDS, TOKEN_TENSOR_FIELDS
from . import partial
from . import segments as version_segments
from .common import (
    FLOAT32_MAX,
    FLOAT_CODES,
    FLOAT_FIELDS,
    INT64_MAX,
    INTEGER_CODES,
    MAX_STEP,
    MAX_UID_BYTES,
    MM_PREFIX,
    SEGMENTS_KEY,
    RawItem,
    RawTensor,
    TrxpError,
    Work,
)
from .measure import Shape
from .shown import is_int, item_where, show, show_list


def _is_utf8(text: str) -> bool:
    """Whether text encodes to UTF-8 (a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _in_range(where: str, field: str, value: Any, low: int, high: int, bounds: str) -> None:
    """Refuse a value that is not an int in [low, high] (bounds: the range as the message says it)."""
    if not is_int(value):
        raise TrxpError(f"{where}: field '{field}' must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise TrxpError(f"{where}: field '{field}' is {show(value)}, outside [{bounds}]")


def _number(where: str, field: str, value: Any) -> None:
    """Refuse a value that is not a finite number that converts to a float64."""
    if not isinstance(value, (int, float)):
        raise TrxpError(f"{where}: field '{field}' must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TrxpError(f"{where}: field '{field}' is {value}, not a finite number")
    if not -sys.float_info.max <= value <= sys.float_info.max:
        raise TrxpError(f"{where}: field '{field}' is {show(value)}, not representable as a float64")


def _reward(where: str, value: Any) -> None:
    """Refuse a reward that is not a number within float32's range: advantages are computed
    from it and served as float32, so a larger one could only fail, or stop, its table."""
    _number(where, "reward", value)
    if not -FLOAT32_MAX <= value <= FLOAT32_MAX:
        raise TrxpError(
            f"{where}: field 'reward' is {show(value)}, beyond float32's range (±{FLOAT32_MAX!r}), "
            "in which advantages are computed and served"
        )


EID_KEYS: Final = frozenset(EID_PARTS)  # an eid dict's keys, as a set
_INT64_BOUNDS = "-2**63, 2**63 - 1"
_FLOAT_MAX: Final = sys.float_info.max

# The ints _plain_uid takes without a closer look: those compiled code compares in a machine word.
_PLAIN_INT: Final = (1 << 62) - 1


def _plain_uid(eid: Any) -> str | None:
    """The uid of an eid that plainly passes _check_eid (parts of their exact types, ints well
    inside its bounds, an ASCII uid without NUL whose only '/' are its four separators, short),
    made as EID.uid makes it; None to leave the eid to _check_eid's detailed checks."""
    if type(eid) is not dict or len(eid) != len(EID_KEYS):  # five keys, and (below) each of EID_KEYS
        return None
    try:
        batch, task, run, step, suffix = eid["batch"], eid["task"], eid["run"], eid["step"], eid["suffix"]
    except KeyError:
        return None
    if not (
        type(run) is int
        and 0 <= run <= _PLAIN_INT
        and type(step) is int
        and 0 <= step <= MAX_STEP
        and type(suffix) is str
        and (type(batch) is str or (type(batch) is int and -_PLAIN_INT <= batch <= _PLAIN_INT))
        and (type(task) is str or (type(task) is int and -_PLAIN_INT <= task <= _PLAIN_INT))
    ):
        return None
    # Each part written as str() writes it, an int's known to be one (compiled code writes it faster),
    # each part typed str, which compiled code joins without a str() of it.
    batch_text = batch if isinstance(batch, str) else _text(batch)
    task_text = task if isinstance(task, str) else _text(task)
    suffix_text: str = suffix
    uid = f"{batch_text}/{task_text}/{_text(run)}/{_text(step)}/{suffix_text}"
    if len(uid) > MAX_UID_BYTES or not uid.isascii() or uid.count("/") != 4 or "\0" in uid:
        return None
    return uid


def _text(number: int) -> str:
    """str(number), the common small ones looked up rather than written (an eid's four ints)."""
    return _TEXTS[number] if 0 <= number < len(_TEXTS) else str(number)


_TEXTS: Final = [str(number) for number in range(1 << 12)]


def _check_eid(index: int, eid: Any) -> str:
    """Validate an eid; return its uid, which reads unambiguously from the right: task and
    suffix hold no '/', run and step are non-negative ints, so only batch may hold '/'."""
    uid = _plain_uid(eid)
    if uid is not None:
        return uid
    where = f"item {index}"
    if not isinstance(eid, dict):
        raise TrxpError(f"{where}: field 'eid' is missing or not a dict")
    if eid.keys() != EID_KEYS:
        unknown = [key for key in eid if key not in EID_PARTS]
        if unknown:
            raise TrxpError(
                f"{where}: field 'eid' has unknown keys {show_list(unknown)} (it holds {', '.join(EID_PARTS)})"
            )
        for part in EID_PARTS:
            if part not in eid:
                raise TrxpError(f"{where}: field 'eid.{part}' is missing")
    for part in ("batch", "task"):
        value = eid[part]
        if type(value) is str or (type(value) is int and -(2**63) <= value <= INT64_MAX):
            continue  # the common cases without a call
        if not isinstance(value, str):
            if not is_int(value):
                raise TrxpError(f"{where}: field 'eid.{part}' must be an int or str, got {type(value).__name__}")
            _in_range(where, f"eid.{part}", value, -(2**63), INT64_MAX, _INT64_BOUNDS)
    run, step, suffix = eid["run"], eid["step"], eid["suffix"]
    if type(run) is not int or not 0 <= run <= INT64_MAX:  # the common case without a call
        _in_range(where, "eid.run", run, 0, INT64_MAX, "0, 2**63 - 1")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        _in_range(where, "eid.step", step, 0, MAX_STEP, "0, 2**31 - 1")
    if not isinstance(suffix, str):
        raise TrxpError(f"{where}: field 'eid.suffix' must be a str, got {type(suffix).__name__}")
    for part in ("task", "suffix"):
        if isinstance(eid[part], str) and "/" in eid[part]:
            raise TrxpError(f"{where}: field 'eid.{part}' contains '/' ({show(eid[part])}); only batch may")
    uid = EID(**eid).uid
    if "\0" in uid:
        raise TrxpError(f"{where}: field 'eid' contains a NUL character")
    try:
        uid_bytes = uid.encode("utf-8")
    except UnicodeEncodeError:
        raise TrxpError(f"{where}: field 'eid' is not valid Unicode") from None
    if len(uid_bytes) > MAX_UID_BYTES:
        raise TrxpError(f"{where}: uid is {len(uid_bytes)} bytes, longer than {MAX_UID_BYTES}")
    return uid


def check_meta(index: int, item: Any, shape: Shape) -> str:
    """Validate the metadata of one item: what the server, its estimators and trainers rely on.
    Returns its uid, made once here, for the store's entry (RawItem.checked_uid).

    Each check is guarded by a test of the common case (a float reward, an int in range, a
    field left None), so the full check, and the item's name for its message, only run when
    that test fails."""
    if not isinstance(item, dict):
        raise TrxpError(f"item {index}: expected a dict, got {type(item).__name__}")
    uid = _check_eid(index, item.get("eid"))
    shape.item(index, uid, item)
    reward = item.get("reward")
    if reward is not None and not (type(reward) is float and -FLOAT32_MAX <= reward <= FLOAT32_MAX):
        _reward(item_where(index, uid), reward)
    prompt_length = item.get("prompt_length", 1)
    if type(prompt_length) is not int or not 0 <= prompt_length <= INT64_MAX:
        _in_range(item_where(index, uid), "prompt_length", prompt_length, 0, INT64_MAX, "0, 2**63 - 1")
    info = item.get("info", _ABSENT)  # each of the fields a dict, info read once
    if not isinstance(info, dict):
        raise TrxpError(f"{item_where(index, uid)}: field 'info' must be a dict")
    if not isinstance(item.get("metrics", _ABSENT), dict):
        raise TrxpError(f"{item_where(index, uid)}: field 'metrics' must be a dict")
    if info:
        version = info.get("model_version")
        if version is not None and not (type(version) is int and 0 <= version <= INT64_MAX):
            _in_range(item_where(index, uid), "info.model_version", version, 0, INT64_MAX, "0, 2**63 - 1")
        priority = info.get("priority")
        if priority is not None and not (type(priority) is float and -_FLOAT_MAX <= priority <= _FLOAT_MAX):
            _number(item_where(index, uid), "info.priority", priority)
        if "partial" in info or "partial_offset" in info:
            partial.check(item_where(index, uid), item)
    for name in _TEXT_FIELDS:
        if item.get(name) is not None and not isinstance(item[name], str):
            raise TrxpError(f"{item_where(index, uid)}: field '{name}' must be a str or None")
    for name in _LIST_FIELDS:
        if item.get(name) is not None and not isinstance(item[name], list):
            raise TrxpError(f"{item_where(index, uid)}: field '{name}' must be a list or None")
    custom = item.get("custom_fields", _NONE_LISTED)
    if not isinstance(custom, list) or (
        custom
        and not all(
            isinstance(cf, dict)
            and all(isinstance(cf.get(k), str) for k in ("source_field", "destination_field", "data_type"))
            for cf in custom
        )
    ):
        raise TrxpError(
            f"{item_where(index, uid)}: field 'custom_fields' must be a list of source/destination/data_type strings"
        )
    keys = item.get("multi_modal_input_keys", _NONE_LISTED)
    if not isinstance(keys, list) or (keys and not all(isinstance(k, str) and _is_utf8(k) for k in keys)):
        raise TrxpError(
            f"{item_where(index, uid)}: field 'multi_modal_input_keys' must be a list of str (UTF-8, they name tensors)"
        )
    if keys and len(set(keys)) != len(keys):
        raise TrxpError(f"{item_where(index, uid)}: field 'multi_modal_input_keys' lists a key twice")
    if custom or keys:
        shape.work.charge(len(custom) + len(keys))
    return uid


# The fields check_meta checks by kind, and what it reads for a field that is not there: a dict, a
# list (never changed; one for every item, not one made for each).
_TEXT_FIELDS: Final[tuple[str, ...]] = ("truncate_status", "response_text", "prompt_text")
_LIST_FIELDS: Final[tuple[str, ...]] = ("messages", "tools", "chosen_messages", "rejected_messages")
_ABSENT: Final[dict[str, Any]] = {}
_NONE_LISTED: Final[list[Any]] = []


def check_tensors(index: int, item: RawItem, work: Work) -> None:
    """Validate the tensors of one item against its metadata."""
    meta, tensors = item.meta, item.tensors
    keys = meta.get("multi_modal_input_keys", _NONE_LISTED)
    work.charge(len(keys) + len(tensors))
    if not keys and _plain_tensors(meta, tensors):
        return
    for key in keys:
        if MM_PREFIX + key not in tensors:
            raise TrxpError(f"{_where(index, item)}: multi-modal input {show(key)} is listed but has no tensor")
    listed = set(keys) if keys else _NONE
    for name in tensors:
        if name.startswith(MM_PREFIX) and name[len(MM_PREFIX) :] not in listed:
            raise TrxpError(f"{_where(index, item)}: tensor {show(name)} is not listed in multi_modal_input_keys")
    tokens = tensors.get("tokens")
    if tokens is None:
        raise TrxpError(f"{_where(index, item)}: field 'tokens' is missing")
    for name in _TOKEN_FIELDS:
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if tensor.dtype not in INTEGER_CODES and tensor.dtype not in FLOAT_CODES:  # Trinity accepts float ids
            raise TrxpError(
                f"{_where(index, item)}: field '{name}' must hold token ids (integer or floating point), "
                f"got {tensor.dtype}"
            )
        if len(tensor.shape) != 1:
            raise TrxpError(f"{_where(index, item)}: field '{name}' must be 1-D, got shape {list(tensor.shape)}")
    prompt_length = meta.get("prompt_length", 1)
    numel = tokens.shape[0]
    if prompt_length > numel:
        raise TrxpError(
            f"{_where(index, item)}: field 'prompt_length' is {prompt_length}, more than the {numel} tokens"
        )
    response_length = numel - prompt_length
    segments = meta.get("info", _ABSENT).get(SEGMENTS_KEY)
    if segments is not None:
        work.charge(len(segments) if isinstance(segments, (list, tuple)) else 1)
        version_segments.check(_where(index, item), segments, response_length)
    for name in _RESPONSE_FIELDS:
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if len(tensor.shape) != 1:
            raise TrxpError(f"{_where(index, item)}: field '{name}' must be 1-D, got shape {list(tensor.shape)}")
        if tensor.shape[0] != response_length:
            raise TrxpError(
                f"{_where(index, item)}: field '{name}' has length {tensor.shape[0]}, but the response has "
                f"{response_length} tokens ({numel} tokens - prompt_length {prompt_length})"
            )
        if name in FLOAT_FIELDS and tensor.dtype not in FLOAT_CODES:
            raise TrxpError(f"{_where(index, item)}: field '{name}' must be floating point, got {tensor.dtype}")
        if name == "token_level_reward":
            check_rewards(index, item, tensor)
        if name == "action_mask" and tensor.dtype != "BOOL" and tensor.dtype not in INTEGER_CODES:
            raise TrxpError(f"{_where(index, item)}: field 'action_mask' must be bool or integer, got {tensor.dtype}")


def _plain_tensors(meta: dict[str, Any], tensors: dict[str, RawTensor]) -> bool:
    """Whether check_tensors passes an item without multi-modal inputs or version segments, each
    tensor looked at once by its field's kind rather than each field looked up (a push checks every
    experience); False leaves it to check_tensors' checks in their order, which name the first
    thing wrong."""
    tokens = tensors.get("tokens")
    prompt_length = meta.get("prompt_length", 1)
    info = meta.get("info", _ABSENT)
    if tokens is None or len(tokens.shape) != 1 or type(prompt_length) is not int or type(info) is not dict:
        return False
    response_length = tokens.shape[0] - prompt_length
    if response_length < 0 or (info and info.get(SEGMENTS_KEY) is not None):
        return False
    for name, tensor in tensors.items():
        kind = _KINDS.get(name)
        if kind is None:
            if name.startswith(MM_PREFIX):
                return False
            continue
        dtype, dims = tensor.dtype, tensor.shape
        if len(dims) != 1:
            return False
        if kind == _TOKEN_IDS:
            if dtype not in INTEGER_CODES and dtype not in FLOAT_CODES:
                return False
        elif dims[0] != response_length:
            return False
        elif kind == _MASK:
            if dtype != "BOOL" and dtype not in INTEGER_CODES:
                return False
        elif dtype not in FLOAT_CODES or (kind == _REWARD and (not_finite(tensor) or beyond_float32(tensor))):
            return False
    return True


# The kind of each field check_tensors checks: token ids, and of the response's fields the action
# mask, the token-level reward and the other floats.
_TOKEN_IDS: Final = 1
_MASK: Final = 2
_REWARD: Final = 3
_FLOATS: Final = 4
_KINDS: Final[dict[str, int]] = {
    **{name: _TOKEN_IDS for name in TOKEN_TENSOR_FIELDS},
    **{name: _FLOATS for name in RESPONSE_TENSOR_FIELDS},
    "action_mask": _MASK,
    "token_level_reward": _REWARD,
}


# Of each float dtype: its size, the byte holding its exponent's high bits and their mask there, and
# the byte and mask of the rest of its exponent (mask 0: none). A value is NaN or infinite where
# every bit of both masks is set (F8_E4M3, the "fn" kind, has NaN only and no infinity).
_EXPONENT = {
    "F64": (8, 7, 0x7F, 6, 0xF0),
    "F32": (4, 3, 0x7F, 2, 0x80),
    "BF16": (2, 1, 0x7F, 0, 0x80),
    "F16": (2, 1, 0x7C, 0, 0),
    "F8_E5M2": (1, 0, 0x7C, 0, 0),
    "F8_E4M3": (1, 0, 0x7F, 0, 0),
}
# For each mask: a byte -> 1 where it has every bit of the mask set, else 0 (bytes.translate's table).
_ALL_SET = {mask: bytes(int(b & mask == mask) for b in range(256)) for mask in (0x7F, 0xF0, 0x80, 0x7C)}


def check_rewards(index: int, item: RawItem, tensor: RawTensor) -> None:
    """Refuse the token-level rewards `tensor` (of item `index`, or of its data that has come) that
    hold NaN, infinity or a value beyond float32's range: TrxpError naming the item."""
    if not_finite(tensor):
        raise TrxpError(
            f"{_where(index, item)}: field 'token_level_reward' holds NaN or infinity; a reward is a finite number"
        )
    if beyond_float32(tensor):
        raise TrxpError(
            f"{_where(index, item)}: field 'token_level_reward' holds a value beyond float32's range"
            f" (±{FLOAT32_MAX!r}), where the estimators compute, as a reward's must be within"
        )


def not_finite(tensor: RawTensor) -> bool:
    """Whether a float tensor holds NaN or infinity, read from its exponents' bytes a byte column
    at a time (C loops: a few µs for thousands of values). False for one whose data is not there
    (a payload read as it arrives, parse_head's empty views)."""
    size, high, high_mask, low, low_mask = _EXPONENT[tensor.dtype]
    data = memoryview(tensor.data).cast("B")
    if len(data) != tensor.numel * size:
        return False
    flagged = bytes(data[high::size]).translate(_ALL_SET[high_mask])
    if 1 not in flagged:
        return False
    if not low_mask:
        return True
    rest = bytes(data[low::size]).translate(_ALL_SET[low_mask])
    return int.from_bytes(flagged, "little") & int.from_bytes(rest, "little") != 0


def beyond_float32(tensor: RawTensor) -> bool:
    """Whether a float64 tensor holds a finite value beyond float32's range (the frameworks'
    estimators compute in float32: such a reward is infinite there); False for narrower dtypes,
    and for one whose data is not there (as not_finite)."""
    if tensor.dtype != "F64" or len(tensor.data) != tensor.numel * 8 or not tensor.numel:
        return False
    values = memoryview(tensor.data).cast("B").cast("d")
    return max(values) > FLOAT32_MAX or min(values) < -FLOAT32_MAX


_TOKEN_FIELDS: Final[tuple[str, ...]] = TOKEN_TENSOR_FIELDS
_RESPONSE_FIELDS: Final[tuple[str, ...]] = RESPONSE_TENSOR_FIELDS
_NONE: Final[frozenset[str]] = frozenset()


def _where(index: int, item: RawItem) -> str:
    return item_where(index, item.uid)
