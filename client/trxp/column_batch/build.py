"""A batch of experiences as columns, made from a rollout worker's tensors for `push()`.

A worker that holds its batch as tensors (a jagged nested tensor of tokens, a padded-free list of
log-probs, a tensor of rewards) hands them over field by field: each field becomes one column
of values back to back (one torch.cat where it came as a list, none where it came as a nested
tensor or as values and offsets) and the batch one payload (wire.py), with no Experience,
safetensors header or pickle per experience. The server stores each experience exactly as the
same experience pushed as an Experience.
"""

from __future__ import annotations

import itertools
import json
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from expbuf.proto.v1 import buffer_pb2 as pb

from ...schema.experience import EID, EID_PARTS
from ..codec import segments
from ..codec.common import DTYPE_RANK, MM_PREFIX, TrxpError
from ..codec.convert import safetensors_codes
from . import wire
from .items import INFO, SCALARS

if TYPE_CHECKING:
    import torch


class ColumnBatch:
    """Experiences pushed as columns: `eids` (EIDs, Trinity-RFT's or expbuf's, or dicts of
    their parts), one per experience, and `fields`, each tensor field by its name ("tokens",
    required for every experience; "logprobs", "action_mask", ...; "multi_modal_inputs:KEY") as
    one of:

    - a jagged nested tensor (torch.nested, layout=torch.jagged), one row an experience;
    - a tensor of shape [experiences, ...], each experience its row;
    - `(values, offsets)`: experience k's values are `values[offsets[k]:offsets[k + 1]]`;
    - a sequence of tensors, one an experience, None where it has none.

    `reward`, `prompt_length`, `model_version` and `priority` (info["priority"]) are one value an
    experience (a sequence, None where an experience has none, or a 1-D tensor);
    `version_segments` each experience's [version, offset] pairs (info["version_segments"]), or
    None; `info` each experience's other info (a dict of plain data, sent as JSON: a tuple comes
    back a list), or None. `ColumnBatch.uids` names them."""

    def __init__(
        self,
        eids: Sequence[Any],
        fields: Mapping[str, Any],
        *,
        reward: Sequence[float | None] | torch.Tensor | None = None,
        prompt_length: Sequence[int | None] | torch.Tensor | None = None,
        model_version: Sequence[int | None] | torch.Tensor | None = None,
        priority: Sequence[float | None] | torch.Tensor | None = None,
        version_segments: Sequence[Sequence[Sequence[int]] | None] | None = None,
        info: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> None:
        count = len(eids)
        message = pb.ColumnBatch()
        parts = [_eid_parts(eid) for eid in eids]
        self.uids = [EID(**part).uid for part in parts]
        for name, key in (("batch", "batches"), ("task", "tasks")):
            named = [part[name] for part in parts]
            ints = [type(value) is int for value in named]
            if any(ints) and not all(ints):
                raise TrxpError(
                    f"eid.{name} is an int for some experiences and a str for others; a ColumnBatch takes one kind"
                )
            setattr(message, f"int_{key}", bool(ints) and all(ints))
            getattr(message, key).extend(str(value) for value in named)
        message.runs.extend(part["run"] for part in parts)
        message.steps.extend(part["step"] for part in parts)
        message.suffixes.extend(part["suffix"] for part in parts)
        one_value = {
            "reward": reward,
            "prompt_length": prompt_length,
            "model_version": model_version,
            "priority": priority,
        }
        made = [_scalar_column(name, scalar, count) for name, scalar in one_value.items() if scalar is not None]
        if version_segments is not None:
            made.append(_segments_column(version_segments, count))
        if info is not None:
            made.append(_info_column(info, count))
        tensors = [column for name, field in fields.items() for column in _tensor_columns(name, field, count)]
        # The one-value columns first, then the tensors in the order the store keeps an experience's
        # (dtype, then name: pack_item's), so that a server staging a large push reads its head from
        # the first chunk and each large experience's data comes in its stored order.
        tensors.sort(key=lambda made: (-DTYPE_RANK[made[0].dtype], made[0].name))
        for column, _ in made + tensors:
            message.columns.append(column)
        # An experience lists its multi-modal inputs in the order of the fields, as an Experience's dict.
        message.multi_modal_keys.extend(name[len(MM_PREFIX) :] for name in fields if name.startswith(MM_PREFIX))
        self.payload = b"".join(wire.write(message, [data for _, data in made + tensors]))

    def __len__(self) -> int:
        return len(self.uids)


def _eid_parts(eid: Any) -> dict[str, Any]:
    """An eid's parts (an EID's, or a dict's, whose missing parts are EID's defaults), each batch and
    task an int or a str."""
    if isinstance(eid, Mapping):
        unknown = set(eid).difference(EID_PARTS)
        if unknown:
            raise TrxpError(f"an eid has unknown keys {sorted(map(str, unknown))} (it holds {', '.join(EID_PARTS)})")
        eid = EID(**eid)
    parts = {"batch": eid.batch, "task": eid.task, "run": eid.run, "step": eid.step, "suffix": eid.suffix}
    for name in ("batch", "task"):
        if type(parts[name]) not in (int, str):
            raise TrxpError(f"eid.{name} must be an int or a str, got {type(parts[name]).__name__} {parts[name]!r}")
    return parts


def _tensor_columns(name: str, given: Any, count: int) -> list[tuple[pb.Column, memoryview]]:
    """One column of `given` (one a dtype, where a list holds several), with its values' bytes."""
    import torch

    if isinstance(given, tuple):
        if len(given) != 2 or not isinstance(given[0], torch.Tensor):
            raise TrxpError(f"field {name!r}: a tuple is (values, offsets); give one tensor an experience as a list")
        values, offsets = given
        offsets = torch.as_tensor(offsets)
        if offsets.dim() != 1 or offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
            raise TrxpError(f"field {name!r}: offsets must be a 1-D sequence of ints, got {offsets.dtype}")
        return [_jagged(name, values, offsets.tolist(), count)]
    if isinstance(given, torch.Tensor):
        if given.is_nested:
            return [_nested(name, given, count)]
        if given.dim() == 0 or given.shape[0] != count:
            raise TrxpError(f"field {name!r}: a tensor of {list(given.shape)} for {count} experiences")
        rows = given.shape[0]
        return [_column(name, given.reshape(-1), range(rows), [tuple(given.shape[1:])] * rows)]
    if not isinstance(given, list):
        raise TrxpError(
            f"field {name!r}: got {type(given).__name__}; give a list of tensors (one an experience), a nested "
            "tensor, a tensor of a row an experience, or (values, offsets)"
        )
    if len(given) != count:
        raise TrxpError(f"field {name!r}: {len(given)} values for {count} experiences")
    by_dtype: dict[torch.dtype, dict[int, torch.Tensor]] = {}
    for index, value in enumerate(given):
        if value is not None:
            tensor = torch.as_tensor(value)
            by_dtype.setdefault(tensor.dtype, {})[index] = tensor
    return [
        _column(
            name, torch.cat([t.reshape(-1) for t in held.values()]), list(held), [tuple(t.shape) for t in held.values()]
        )
        for held in by_dtype.values()
    ]


def _nested(name: str, given: torch.Tensor, count: int) -> tuple[pb.Column, memoryview]:
    """A nested tensor's column: a jagged one's values and offsets as they are, where its rows are
    whole and its ragged dimension the first after the batch's; any other, row by row."""
    import torch

    nested: Any = given  # a NestedTensor, whose jagged methods torch's stubs do not list
    if given.layout == torch.jagged and nested.lengths() is None and nested._ragged_idx == 1:
        return _jagged(name, nested.values(), nested.offsets().tolist(), count)
    rows = list(given.unbind())
    if len(rows) != count:
        raise TrxpError(f"field {name!r}: a nested tensor of {len(rows)} rows for {count} experiences")
    (column,) = _tensor_columns(name, [row.contiguous() for row in rows], count)
    return column


def _jagged(name: str, values: torch.Tensor, offsets: list[int], count: int) -> tuple[pb.Column, memoryview]:
    if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != values.shape[0]:
        raise TrxpError(
            f"field {name!r}: offsets must run from 0 to the {values.shape[0]} rows of its values, "
            f"one more than the {count} experiences"
        )
    inner = tuple(values.shape[1:])
    shapes = []
    for start, end in itertools.pairwise(offsets):
        if end < start:
            raise TrxpError(f"field {name!r}: offsets decrease ({start} then {end})")
        shapes.append((end - start, *inner))
    return _column(name, values.reshape(-1), range(count), shapes)


def _column(
    name: str, flat: torch.Tensor, items: Sequence[int], shapes: Sequence[tuple[int, ...]]
) -> tuple[pb.Column, memoryview]:
    """A column of `flat`'s values (on the CPU, contiguous) held by the experiences `items`."""
    import torch

    code = safetensors_codes().get(flat.dtype)
    if code is None:
        raise TrxpError(f"field {name!r}: dtype {flat.dtype} has no safetensors code")
    if not (flat.is_cpu and flat.is_contiguous()):
        flat = flat.detach().to("cpu").contiguous()
    ndim = len(shapes[0]) if shapes else 1
    if any(len(shape) != ndim for shape in shapes):
        raise TrxpError(f"field {name!r}: its experiences' tensors differ in their number of dimensions")
    column = pb.Column(name=name, dtype=code, items=items, ndim=ndim)
    column.shapes.extend(dim for shape in shapes for dim in shape)
    data = flat.detach().view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")
    return column, data


def _segments_column(given: Sequence[Sequence[Sequence[int]] | None], count: int) -> tuple[pb.Column, memoryview]:
    """The column of each experience's version segments ([version, offset] pairs), None where an
    experience has none (one version generated its response: its model_version)."""
    import torch

    if len(given) != count:
        raise TrxpError(f"'version_segments': {len(given)} values for {count} experiences")
    items = [index for index, pairs in enumerate(given) if pairs is not None]
    try:
        pairs = [torch.as_tensor(given[index], dtype=torch.int64).reshape(-1, 2) for index in items]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TrxpError(f"'version_segments' must hold [version, offset] pairs of ints or None: {exc}") from None
    flat = torch.cat(pairs) if pairs else torch.empty((0, 2), dtype=torch.int64)
    column = pb.Column(name=segments.KEY, dtype="I64", items=items, ndim=2)
    column.shapes.extend(dim for pair in pairs for dim in pair.shape)
    return column, flat.reshape(-1).view(torch.uint8).numpy().data


def _info_column(given: Sequence[Mapping[str, Any] | None], count: int) -> tuple[pb.Column, memoryview]:
    """The column of each experience's other info, as JSON in UTF-8, None where it has none."""
    if len(given) != count:
        raise TrxpError(f"'info': {len(given)} values for {count} experiences")
    items, texts = [], []
    for index, one in enumerate(given):
        if one is None:
            continue
        try:
            texts.append(json.dumps(dict(one), ensure_ascii=False, separators=(",", ":")).encode())
        except (TypeError, ValueError) as exc:
            raise TrxpError(f"'info' of experience {index} is not plain data JSON can hold: {exc}") from None
        items.append(index)
    column = pb.Column(name=INFO, dtype="U8", items=items, ndim=1, shapes=[len(text) for text in texts])
    return column, memoryview(b"".join(texts))


def _scalar_column(name: str, given: Any, count: int) -> tuple[pb.Column, memoryview]:
    """A column of one value an experience, None where an experience has none."""
    import torch

    listed = given.tolist() if isinstance(given, torch.Tensor) else list(given)
    if len(listed) != count:
        raise TrxpError(f"{name!r}: {len(listed)} values for {count} experiences")
    items = [index for index, value in enumerate(listed) if value is not None]
    dtype = torch.float64 if SCALARS[name] == "F64" else torch.int64
    if dtype is torch.int64:
        if not all(isinstance(listed[i], numbers.Integral) and not isinstance(listed[i], bool) for i in items):
            raise TrxpError(f"{name!r} must hold ints or None")
        listed = [None if value is None else int(value) for value in listed]
    try:
        flat = torch.tensor([listed[index] for index in items], dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TrxpError(f"{name!r} must hold numbers or None: {exc}") from None
    column = pb.Column(name=name, dtype=SCALARS[name], items=items, ndim=0)
    return column, flat.view(torch.uint8).numpy().data
