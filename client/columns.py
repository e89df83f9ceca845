"""A columnar batch's fields as tensors: `sample(..., fields=[...])` gives each batch's `columns`.

A trainer that reads tensors, not Experience objects, asks for the fields it trains on and gets,
per field, every experience's values back to back in one tensor, with `offsets` where each
experience's rows begin: the jagged layout of `torch.nested` (`Column.nested()`) and of
TransferQueue, with no Python object per experience. Each field's tensor is made on its bytes
where they are in the reply, which the client keeps in one writable buffer (copied once from
gRPC's bytes: rpc/sample_reply.py), aligned there by the server; the checks are those of the reply's
framing: every column's values fit its shapes exactly, or the batch is not confirmed and goes
back (DataLossError).

A field stored with several dtypes in one batch (log-probs sent as float32 by one rollout worker
and bfloat16 by another) is promoted to one dtype; one stored with several ranks, or with
trailing dimensions that differ, has no jagged form: its `values` and `offsets` are None and
`tensors` holds each experience's tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .trxp.codec.common import ITEMSIZE
from .trxp.codec.convert import torch_dtypes

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict

    from .schema.balance import ModelShape


@dataclass(frozen=True)
class Column:
    """One tensor field of a batch. `items` are the batch positions (of `uids`) of the
    experiences that have it, `shapes` their shapes. Jagged along the first dimension:
    experience k's rows are `values[offsets[k]:offsets[k + 1]]`."""

    name: str
    items: list[int]
    shapes: list[tuple[int, ...]]
    values: torch.Tensor | None
    offsets: torch.Tensor | None
    parts: tuple[torch.Tensor, ...] = ()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Each experience's tensor (views of `values` where the column is jagged)."""
        if self.values is None or self.offsets is None:
            return list(self.parts)
        bounds = self.offsets.tolist()
        return [self.values[bounds[k] : bounds[k + 1]].reshape(shape) for k, shape in enumerate(self.shapes)]

    def nested(self) -> torch.Tensor:
        """The column as a jagged nested tensor (torch.nested, layout=torch.jagged): one row per
        experience that has the field. Its experiences' tensors must be of rank 1 or more."""
        import torch

        if self.values is None or self.offsets is None:
            raise ValueError(f"column {self.name!r} has experiences of different ranks or trailing dimensions")
        if any(not shape for shape in self.shapes):
            raise ValueError(f"column {self.name!r} holds one value per experience: use `values`")
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets)


class Columns(dict[str, Column]):
    """A columnar batch's fields by name, in the order asked, and `missing`: the fields asked for
    that no experience of the batch has (the reply's missing_fields), which have no column. Looking
    one of those up raises a KeyError that says so, as does a field not asked for: a trainer
    learns why where it looks, not from a bare KeyError further on."""

    def __init__(self, columns: Mapping[str, Column] | None = None, missing: Sequence[str] = ()) -> None:
        super().__init__(columns or {})
        self.missing = tuple(missing)

    def __missing__(self, name: str) -> Column:
        if name in self.missing:
            raise KeyError(
                f"field {name!r}: no experience of this batch has it (it was asked for, and is in the batch's "
                "missing_fields): the experiences were pushed without it"
            )
        raise KeyError(
            f"field {name!r} was not asked for (the batch's columns: {', '.join(self) or 'none'}): sample or read it "
            "with fields=[...] naming it"
        )


def as_tensordict(columns: Mapping[str, Column], count: int) -> TensorDict:
    """A columnar batch of `count` experiences as a TensorDict of batch size [count] (the form
    verl's and TransferQueue's trainers read): each field of tensors a jagged nested tensor, one
    row per experience (`Column.nested()`), each of one value per experience a tensor of `count`,
    all made on the batch's bytes with no copy. A field that some experience lacks, or whose
    experiences differ in rank, has no place in it: ValueError naming it, as for a field asked for
    that no experience has (`Columns.missing`)."""
    try:
        from tensordict import TensorDict
    except ImportError:
        raise ImportError("batch.tensordict() needs the tensordict package (pip install tensordict)") from None
    lacking = missing_fields(columns)
    if lacking:
        raise ValueError(
            f"field {lacking[0]!r} was asked for, but no experience of the batch's {count} has it; a TensorDict "
            "holds every field of every experience: read batch.columns (and batch.missing_fields)"
        )
    fields: dict[str, torch.Tensor] = {}
    for name, column in columns.items():
        if len(column.items) != count:
            raise ValueError(
                f"field {name!r} is missing from {count - len(column.items)} of the batch's {count} experiences; "
                "a TensorDict holds every field of every experience: read batch.columns"
            )
        if column.values is not None and all(not shape for shape in column.shapes):
            fields[name] = column.values
        else:
            fields[name] = column.nested()
    return TensorDict(fields, batch_size=[count])


def missing_fields(columns: Mapping[str, Column]) -> list[str]:
    """The fields asked for that no experience of a columnar batch has (none known of a plain mapping)."""
    return list(columns.missing) if isinstance(columns, Columns) else []


def decode_columns(
    columns: Any, count: int, values: Sequence[memoryview] | None = None, missing: Sequence[str] = ()
) -> Columns:
    """The `columns` of a SampleReply (pb.Column messages) of a batch of `count` experiences,
    by field: checked against their framing, a field's columns of several dtypes merged. A
    ValueError names what does not fit. `values`: each column's values as a writable view of
    the reply (rpc/sample_reply.py), which its tensor is made on; without them, each column's
    own values are copied into a buffer of its own. `missing`: the reply's missing_fields."""
    import torch

    dtypes = torch_dtypes()
    by_name: dict[str, list[tuple[list[int], list[tuple[int, ...]], torch.Tensor]]] = {}
    for index, column in enumerate(columns):
        data = values[index] if values is not None else column.values
        if column.dtype not in dtypes:
            raise ValueError(f"column {column.name!r}: unknown dtype {column.dtype!r}")
        items = list(column.items)
        shapes = _shapes(column, len(items))
        if any(not 0 <= item < count for item in items) or len(set(items)) != len(items):
            raise ValueError(f"column {column.name!r}: its experiences are not positions of the batch")
        numel = sum(math.prod(shape) for shape in shapes)
        if numel * ITEMSIZE[column.dtype] != len(data):
            raise ValueError(f"column {column.name!r}: {len(data)} bytes of values for {numel} {column.dtype} values")
        writable = data if isinstance(data, memoryview) and not data.readonly else bytearray(data)
        flat = (
            torch.frombuffer(writable, dtype=dtypes[column.dtype])
            if numel
            else torch.empty(0, dtype=dtypes[column.dtype])
        )
        by_name.setdefault(column.name, []).append((items, shapes, flat))
    return Columns({name: _merged(name, parts) for name, parts in by_name.items()}, missing)


def _shapes(column: Any, items: int) -> list[tuple[int, ...]]:
    ndim = column.ndim
    dims = list(column.shapes)
    if len(dims) != ndim * items:
        raise ValueError(f"column {column.name!r}: {len(dims)} shape numbers for {items} experiences of rank {ndim}")
    return [tuple(dims[k * ndim : (k + 1) * ndim]) for k in range(items)]


def join_columns(parts: list[tuple[Sequence[int | None], Mapping[str, Column]]], fields: Sequence[str]) -> Columns:
    """The columns of batches joined into one (a sharded client's parts): each part's experience
    k at the position `places[k]` (None: left out) of its part's (places, columns). A column of
    batch positions (`prefix_of`) has its values moved with the experiences they name. The
    columns come in the order of `fields`, the fields asked, as one batch's do, whichever part
    holds each; a field asked is missing from the whole where no part has it."""
    import torch

    pieces: dict[str, list[_Piece]] = {}
    for places, columns in parts:
        for name, column in columns.items():
            tensors = column.tensors
            if name in POSITIONS:  # a position in the part: where that experience now is, or -1
                tensors = [torch.tensor(_place(places, int(t)), dtype=t.dtype).reshape(t.shape) for t in tensors]
            pieces.setdefault(name, []).extend(
                (place, shape, tensor.reshape(-1))
                for item, shape, tensor in zip(column.items, column.shapes, tensors, strict=True)
                if (place := places[item]) is not None
            )
    order = dict.fromkeys([*fields, *pieces])
    missing = [name for name in order if name not in pieces]
    return Columns({name: _column(name, pieces[name]) for name in order if name in pieces}, missing)


POSITIONS = frozenset({"prefix_of"})  # columns whose values are batch positions


def _place(places: Sequence[int | None], position: int) -> int:
    moved = places[position] if 0 <= position < len(places) else None
    return -1 if moved is None else moved


_Piece = tuple[int, tuple[int, ...], "torch.Tensor"]  # an experience's position, shape and flat values


def _merged(name: str, parts: list[tuple[list[int], list[tuple[int, ...]], torch.Tensor]]) -> Column:
    """One Column of a field's columns as they came (each flat, its experiences back to back)."""
    if len(parts) == 1:
        items, shapes, flat = parts[0]
        if _jagged(shapes):
            return Column(name, items, shapes, _rows(flat, shapes), _offsets(shapes))
    pieces: list[_Piece] = []
    for items, shapes, flat in parts:
        at = 0
        for item, shape in zip(items, shapes, strict=True):
            size = math.prod(shape)
            pieces.append((item, shape, flat[at : at + size]))
            at += size
    return _column(name, pieces)


def _column(name: str, pieces: list[_Piece]) -> Column:
    """A Column of experiences' flat values in batch order: jagged where every one has the same
    rank and trailing dimensions, its dtype the promotion of theirs."""
    import torch

    pieces.sort(key=lambda piece: piece[0])
    items = [item for item, _, _ in pieces]
    shapes = [shape for _, shape, _ in pieces]
    if not _jagged(shapes):
        return Column(name, items, shapes, None, None, tuple(flat.reshape(shape) for _, shape, flat in pieces))
    dtype = pieces[0][2].dtype
    for _, _, flat in pieces[1:]:
        dtype = torch.promote_types(dtype, flat.dtype)
    values = torch.cat([flat.to(dtype) for _, _, flat in pieces])
    return Column(name, items, shapes, _rows(values, shapes), _offsets(shapes))


def _jagged(shapes: list[tuple[int, ...]]) -> bool:
    """Whether tensors of these shapes line up along their first dimension."""
    return len({len(shape) for shape in shapes}) == 1 and len({shape[1:] for shape in shapes}) == 1


def _rows(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> torch.Tensor:
    """Flat values as rows: their first dimension joined, the trailing ones kept (the rows
    counted, not inferred: trailing dimensions of 0 leave -1 nothing to infer from)."""
    return flat.reshape(sum(shape[0] for shape in shapes), *shapes[0][1:]) if shapes and shapes[0] else flat


def _offsets(shapes: list[tuple[int, ...]]) -> torch.Tensor:
    """Where each experience's rows begin, and the end: len(shapes) + 1 numbers."""
    import torch

    offsets = torch.zeros(len(shapes) + 1, dtype=torch.int64)
    if shapes:
        offsets[1:] = torch.tensor([shape[0] if shape else 1 for shape in shapes], dtype=torch.int64).cumsum(0)
    return offsets


@dataclass(frozen=True)
class PrefixBranches:
    """A batch's tokens as tree packing takes them (sampled or read with the fields
    `prefix_tokens`, `branch_tokens` and `prefix_of`): each distinct prompt once, and for each
    experience (`items`, its batch position) the prompt it continues and its own tokens after it.
    The runs of a GRPO group share one prompt, so a trainer that packs them as a tree computes
    that prompt once per group."""

    items: list[int]  # the batch positions of the experiences, in order (those with tokens)
    prefixes: list[torch.Tensor]  # each distinct prompt once
    prefix_of: list[int]  # each experience's prompt: an index into prefixes
    branches: list[torch.Tensor]  # each experience's tokens after its prompt

    def tokens(self, k: int) -> torch.Tensor:
        """Experience k's tokens (k-th of items): its prompt, then its branch."""
        import torch

        return torch.cat([self.prefixes[self.prefix_of[k]], self.branches[k]])


def prefix_branches(columns: dict[str, Column]) -> PrefixBranches:
    """The prefix + branches form of a batch whose columns hold `prefix_tokens`, `branch_tokens`
    and `prefix_of` (ValueError naming those it lacks)."""
    lacking = [name for name in ("prefix_tokens", "branch_tokens", "prefix_of") if name not in columns]
    if lacking:
        raise ValueError(f"the batch has no {', '.join(lacking)} column(s): sample or read them to have its prefixes")
    prefixes, branches, owners = columns["prefix_tokens"], columns["branch_tokens"], columns["prefix_of"]
    at = {position: index for index, position in enumerate(prefixes.items)}
    assert owners.values is not None
    owner_of = dict(zip(owners.items, owners.values.tolist(), strict=True))
    return PrefixBranches(
        items=list(branches.items),
        prefixes=prefixes.tensors,
        prefix_of=[at[owner_of[position]] for position in branches.items],
        branches=branches.tensors,
    )


def run_lengths(batch: Any) -> list[int]:
    """Each experience's tokens in a columnar batch (`uids`, `columns`): its `length` column, or
    the first dimension of its `tokens`; 0 for one without (ValueError when the batch has
    neither column)."""
    lengths = [0] * len(batch.uids)
    length = batch.columns.get("length")
    if length is not None:
        assert length.values is not None
        for at, value in zip(length.items, length.values.tolist(), strict=True):
            lengths[at] = int(value)
        return lengths
    tokens = batch.columns.get("tokens")
    if tokens is None:
        raise ValueError("the batch has no length or tokens column: sample it with fields=['length', ...]")
    for at, shape in zip(tokens.items, tokens.shapes, strict=True):
        lengths[at] = shape[0] if shape else 0
    return lengths


def rank_parts(batch: Any, ranks: int, balance: str, model: ModelShape | None, equal: bool) -> list[list[str]]:
    """The uids of each of `ranks` ranks, a columnar batch's groups split as a server splits a
    leased step (schema/balance.split_runs, over the runs' tokens; any lengths for "count")."""
    from .schema.balance import split_runs

    lengths = [0] * len(batch.uids) if balance == "count" else run_lengths(batch)
    return split_runs(batch.uids, batch.group_ids, lengths, ranks, balance, model, equal)
