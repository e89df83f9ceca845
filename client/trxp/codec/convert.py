"""Experience objects (expbuf's or Trinity-RFT's) to raw items and back, and raw tensors to
torch tensors; torch is imported only here, and only when tensors are made.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ...schema.experience import EID, META_FIELDS, TENSOR_FIELDS, Experience
from .build import build
from .checks import EID_KEYS, check_meta, check_tensors
from .common import ITEMSIZE, MAX_NESTING, MM_PREFIX, UNBOUNDED, RawItem, RawTensor, TrxpError, Work
from .gc_pause import collector_paused
from .measure import Shape
from .parse import parse
from .shown import show

# For a batch the server sent: only the nesting of the non-empty containers among the fields
# an Experience carries is measured, not their size (UNBOUNDED); most items have none. The
# eid is checked part by part by check_meta.
_WALKED = (*META_FIELDS, "custom_fields")


# ---- Experience objects -----------------------------------------------------------


def decode(payload: bytes | bytearray | memoryview) -> list[Experience]:
    """Decode a TRXP payload into Experience objects whose tensors are views, not copies each.

    Immutable bytes: the tensors' bytes are gathered into one new bytearray per dtype, and
    the tensors are views over it (`gather`): one C-level copy per dtype instead of one per
    tensor, whatever the payload's layout, and every tensor writable without touching the
    caller's bytes. A writable buffer (a bytearray, or a memoryview of one) is handed over
    as it is: its tensors are views of it where their bytes are aligned to their element
    size (copies where not), so writing to it changes them. A view keeps its whole buffer
    alive. The garbage collector's passes wait until it returns (gc_pause.py).
    """
    view = memoryview(payload)
    with collector_paused():
        return _experiences(parse(view), view)


def decode_reply(payload: bytes | bytearray | memoryview) -> list[Experience]:
    """Decode a batch as the server sent it (a sample or a get), as `decode` does, with the
    checks a reader relies on: the sections' bounds, the pickle scan and restricted
    unpickler, each item's eid, fields, tensors and lengths. What it leaves out is the
    store's own bound, the size of each item's metadata written out in full: the server
    measured that when the item was pushed, and a reader never writes it out. A malformed
    reply is refused with a TrxpError that names the problem, as a malformed push is. The
    garbage collector's passes wait until it returns (gc_pause.py)."""
    view = memoryview(payload)
    work = Work.for_payload(len(view))
    with collector_paused():
        return _experiences(
            parse(view, work=work, shape=Shape(work, UNBOUNDED, check_keys=False, containers_of=_WALKED)), view
        )


def _experiences(items: list[RawItem], view: memoryview) -> list[Experience]:
    if not view.readonly:
        return [to_experience(item) for item in items]
    _, tensors = gather(items)
    return [to_experience(item, made) for item, made in zip(items, tensors, strict=True)]


def gather(items: list[RawItem]) -> tuple[list[bytearray], list[dict[str, torch.Tensor]]]:
    """Copy the bytes of every tensor of `items` into one new bytearray per dtype, back to
    back in item order; the bytearrays, and each item's tensors as views over them.

    One buffer per dtype keeps every tensor aligned to its element size without padding,
    and makes the tensors of a dtype with one `split_with_sizes` rather than a
    `torch.frombuffer` each."""
    import torch

    pieces: dict[str, list[bytes | memoryview]] = {}
    for item in items:
        for raw in item.tensors.values():
            runs = pieces.get(raw.dtype)
            if runs is None:
                runs = pieces[raw.dtype] = []
            runs.append(raw.data)
    dtypes = torch_dtypes()
    buffers: list[bytearray] = []
    views: dict[str, Iterator[torch.Tensor]] = {}
    for code, runs in pieces.items():
        dtype, itemsize = dtypes[code], ITEMSIZE[code]
        buffer = bytearray().join(runs)  # malloc'd, so aligned to at least 8 bytes
        shift = -_address(buffer) % itemsize
        if shift:  # not seen with CPython's allocator; kept correct all the same
            buffer = bytearray(shift) + buffer
        buffers.append(buffer)
        whole = (
            torch.frombuffer(buffer, dtype=dtype, offset=shift) if len(buffer) > shift else torch.empty(0, dtype=dtype)
        )
        views[code] = iter(whole.split_with_sizes([len(run) // itemsize for run in runs]))
    made: list[dict[str, torch.Tensor]] = []
    for item in items:
        tensors = {}
        for key, raw in item.tensors.items():
            tensor = next(views[raw.dtype])
            tensors[key] = tensor if len(raw.shape) == 1 else tensor.reshape(raw.shape)
        made.append(tensors)
    return buffers, made


def _address(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if buffer else 0


def encode(experiences: Iterable[Any]) -> bytes:
    """Encode expbuf or Trinity-RFT experiences (read by attribute name) into TRXP; a refusal
    names the experience by its place among them."""
    batch = _Batch()
    return build([batch.item(index, exp) for index, exp in enumerate(experiences)])


def to_experience(item: RawItem, tensors: dict[str, torch.Tensor] | None = None) -> Experience:
    """An Experience of a parsed item; `tensors` are its tensors when already made (`gather`).

    Made without Experience's __init__, whose keyword handling and default factories cost
    more than the rest of a decoded experience: its fields are set at once, each of its
    field's type, those the item lacks to their defaults."""
    meta = item.meta
    made = {name: tensor_of(raw) for name, raw in item.tensors.items()} if tensors is None else tensors
    values = _FIELD_DEFAULTS.copy()
    if meta.keys() <= _ITEM_KEYS:  # the server's items, and Trinity-RFT's: nothing to leave out
        values.update(meta)
        values.pop("multi_modal_input_keys", None)
    else:
        values.update({name: meta[name] for name in _ITEM_KEYS & meta.keys() if name != "multi_modal_input_keys"})
    for name, factory in _FIELD_FACTORIES:
        if name not in meta:
            values[name] = factory()
    eid = meta["eid"]
    if type(eid) is dict and eid.keys() == EID_KEYS:  # its five parts, set at once
        values["eid"] = made_eid = object.__new__(EID)
        made_eid.__dict__ = eid.copy()
    else:
        values["eid"] = EID(**eid)
    values.update({name: tensor for name, tensor in made.items() if not name.startswith(MM_PREFIX)})
    values["multi_modal_inputs"] = {key: made[MM_PREFIX + key] for key in meta.get("multi_modal_input_keys", [])}
    experience = object.__new__(Experience)
    experience.__dict__ = values
    return experience


# Experience's fields with a plain default (None for tokens, which a decoded item always has);
# the metadata fields whose default is made by a factory, made only when an item lacks them;
# the metadata keys an item may carry that become fields (eid and multi_modal_input_keys are
# read on their own).
_FIELD_DEFAULTS: dict[str, Any] = {
    f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(Experience)
}
_FIELD_FACTORIES = [
    (f.name, f.default_factory)
    for f in dataclasses.fields(Experience)
    if f.name in ("info", "metrics", "custom_fields") and f.default_factory is not dataclasses.MISSING
]
_ITEM_KEYS = frozenset({"eid", *META_FIELDS, "custom_fields", "multi_modal_input_keys"})


def from_experience(exp: Any) -> RawItem:
    """Read an Experience-like object (expbuf's or Trinity-RFT's) into a RawItem."""
    return _Batch().item(0, exp)


class _Batch:
    """The caller's experiences of one batch read into checked RawItems, with what each item
    takes fetched once: torch's Tensor type, the dtype table and a metadata measure. Fetched
    for each tensor or item, they took a tenth of an encode."""

    def __init__(self) -> None:
        import torch

        self.tensor_type = torch.Tensor
        self.codes = safetensors_codes()
        # The caller's own objects: checked like a payload, without its size bounds. Only the
        # non-empty containers among the caller's fields (info, metrics, messages, tools...)
        # are measured: a walk of anything else could not refuse it. The eid, custom fields
        # and multi-modal keys are made by item() of values check_meta checks part by part, and
        # the scalar fields are of a type check_meta checks too.
        self.shape = Shape(Work(UNBOUNDED), UNBOUNDED, check_keys=True, containers_of=META_FIELDS)

    def item(self, index: int, exp: Any) -> RawItem:
        """Experience number `index` of the batch as a checked RawItem."""
        eid = exp.eid
        meta: dict[str, Any] = {"eid": eid if isinstance(eid, dict) else _eid_dict(eid)}
        for name in META_FIELDS:
            meta[name] = getattr(exp, name, None)
        meta["info"] = {} if meta["info"] is None else _plain(meta["info"])
        meta["metrics"] = {} if meta["metrics"] is None else _plain(meta["metrics"])
        if meta["prompt_length"] is None:
            meta["prompt_length"] = 1
        if meta["reward"] is not None:
            meta["reward"] = _float("reward", meta["reward"])
        meta["custom_fields"] = [_custom_field_dict(cf) for cf in getattr(exp, "custom_fields", None) or []]
        mm = getattr(exp, "multi_modal_inputs", None) or {}
        meta["multi_modal_input_keys"] = list(mm)
        for key in mm:
            if not isinstance(key, str):
                raise TrxpError(f"field 'multi_modal_inputs' has a key of type {type(key).__name__}; keys must be str")
        tensor_type, codes = self.tensor_type, self.codes
        tensors = {}
        for name in TENSOR_FIELDS:
            value = getattr(exp, name, None)
            if value is not None:
                tensors[name] = _raw(value, tensor_type, codes)
        for key, value in mm.items():
            tensors[MM_PREFIX + key] = _raw(value, tensor_type, codes)
        item = RawItem(meta, tensors)
        # Each item's containers measured afresh, as one experience alone: a caller that changes
        # a container between two experiences (or frees one, its id taken by another) is not
        # judged by what the container was.
        self.shape.forget()
        check_meta(index, meta, self.shape)
        check_tensors(index, item, self.shape.work)
        return item


def _eid_dict(eid: Any) -> dict[str, Any]:
    return {"batch": eid.batch, "task": eid.task, "run": eid.run, "step": eid.step, "suffix": eid.suffix}


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` with the numpy and torch scalars in it (at any depth of its dicts, lists and tuples)
    as the Python numbers they hold: a reward function's numpy values land in info and metrics,
    and a numpy float, a float to the checks, was pickled as numpy's and refused by the server
    ("pickle opcode STACK_GLOBAL is not plain data"), the push with it. Containers are copied only
    where something in them changes; past MAX_NESTING (a cycle among them) left as they are, for
    the checks to refuse."""
    kind = type(value)
    if depth > MAX_NESTING:
        return value
    if kind is dict:
        made = {key: _plain(item, depth + 1) for key, item in value.items()}
        return value if all(made[key] is item for key, item in value.items()) else made
    if kind is list or kind is tuple:
        items = [_plain(item, depth + 1) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else kind(items)
    return python_number(value)


def python_number(value: Any) -> Any:
    """A numpy or torch scalar (np.float64, np.True_, a 0-d tensor) as the Python number it holds;
    anything else as it is."""
    if type(value).__module__ in ("numpy", "torch") and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _float(name: str, value: Any) -> float:
    """A caller's number as the float Trinity-RFT stores, or an error naming the field."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TrxpError(f"field '{name}' must be a number, got {type(value).__name__} {show(value)}") from None


_CUSTOM_FIELD_KEYS = ("source_field", "destination_field", "data_type")


def _custom_field_dict(cf: Any) -> dict[str, str]:
    if isinstance(cf, dict):
        missing = [k for k in _CUSTOM_FIELD_KEYS if k not in cf]
        if missing:
            raise TrxpError(f"field 'custom_fields': an entry lacks {', '.join(missing)}")
        return {k: str(cf[k]) for k in _CUSTOM_FIELD_KEYS}
    return {
        "source_field": cf.source_field,
        "destination_field": cf.destination_field,
        "data_type": str(cf.data_type),
    }


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors code -> torch dtype; torch is imported only when tensors are made."""
    import torch

    return {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3": torch.float8_e4m3fn,
        "I16": torch.int16,
        "U16": torch.uint16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "F32": torch.float32,
        "F64": torch.float64,
        "I64": torch.int64,
        "U64": torch.uint64,
    }


def tensor_of(raw: RawTensor) -> torch.Tensor:
    """A torch tensor over the raw bytes: a view when they are a writable buffer aligned to
    the element size (torch.frombuffer shares it), otherwise a copy that owns its memory."""
    import torch

    dtype = torch_dtypes()[raw.dtype]
    if raw.numel == 0:
        return torch.empty(raw.shape, dtype=dtype)
    data = raw.data
    tensor = None
    if isinstance(data, memoryview) and not data.readonly:
        tensor = torch.frombuffer(data, dtype=dtype)
        if tensor.data_ptr() % dtype.itemsize:  # misaligned: not a view after all
            tensor = None
    if tensor is None:
        tensor = torch.frombuffer(bytearray(data), dtype=dtype)
    return tensor if len(raw.shape) == 1 else tensor.reshape(raw.shape)


def flat_tensor(raw: RawTensor | None, length: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of a stored tensor (an action mask, say), or `fill` where it is absent."""
    import torch

    if raw is None:
        return torch.full((length,), fill, dtype=dtype)
    return tensor_of(raw).reshape(-1).to(dtype)


@functools.cache
def safetensors_codes() -> dict[torch.dtype, str]:
    """torch dtype -> safetensors code, the inverse of torch_dtypes."""
    return {dtype: code for code, dtype in torch_dtypes().items()}


def raw_of(value: Any) -> RawTensor:
    """The raw form of a tensor (or anything torch.as_tensor takes), on the CPU."""
    import torch

    return _raw(value, torch.Tensor, safetensors_codes())


def _raw(value: Any, tensor_type: type[torch.Tensor], codes: dict[torch.dtype, str]) -> RawTensor:
    """raw_of with torch's Tensor type and the dtype table at hand."""
    if isinstance(value, tensor_type):
        tensor = value
    else:
        import torch

        tensor = torch.as_tensor(value)
    if not (tensor.is_cpu and tensor.is_contiguous()):
        tensor = tensor.detach().to("cpu").contiguous()
    code = codes.get(tensor.dtype)
    if code is None:
        raise TrxpError(f"tensor dtype {tensor.dtype} has no safetensors code")
    nbytes = tensor.nbytes
    data = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
    return RawTensor(code, tuple(tensor.shape), data)
