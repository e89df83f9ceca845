"""A batch of stored experiences as columns: for each tensor field asked for, the values of the
experiences that have it, back to back in batch order, with each one's shape.

Each stored experience's tensors are found through its safetensors header, read as join() reads
it (splice.HeaderReads, once a batch for each header: no parse of the metadata pickle, no JSON
parse of a header pack_item wrote), and handed on as views of the stored bytes (the pieces a tensor spans, for a section
stored in pieces: pieces.py): the caller that frames the reply copies each byte once. A field
stored with several dtypes or ranks in one batch makes one column for each (Trinity-RFT lets a
client send log-probs as float32 in one experience and bfloat16 in another); the client merges
them where it can.

A reader may also ask for a share of each experience's tokens (`Shares`: a context-parallel rank's
part of a sequence): each tensor laid along the tokens comes cut to the rows of those positions,
and the rest whole.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from expbuf.client.schema.experience import RESPONSE_TENSOR_FIELDS, TENSOR_FIELDS

from ..codec import segments as version_segments
from ..codec.build import json_text
from ..codec.common import MM_PREFIX, RawTensor
from .pieces import VIEW, Run, Section, Stored, cut, joined, located
from .splice import HeaderRead, HeaderReads

# Columns of one value per experience, by name, with their dtype: what the server keeps beside each
# experience's payload (in its record), and its tokens and prompt's (its stored header's tokens,
# less its response), which a trainer packs micro-batches by, and, in a rank's part of a leased
# step, the cost its split weighed the run by (schema/balance.py: its tokens, 1, or its FLOPs): an
# experience without one (no reward, no version, no tokens, not a part) is left out of its column.
SCALARS = {
    "reward": "F64", "model_version": "I64", "response_length": "I64", "length": "I64", "prompt_length": "I64",
    "cost": "I64",
}  # fmt: skip
_PACK = {"F64": "<%dd", "I64": "<%dq"}
SEGMENTS = version_segments.KEY  # the version segments' column, named as an experience's info names them
# The tensors laid along an experience's response (its tokens after the prompt), as a stored
# header writes their names.
_RESPONSE = frozenset(json_text(name) for name in RESPONSE_TENSOR_FIELDS)
_TOKENS = json_text("tokens")
# The prefix + branches form of a batch's tokens (_Tree): fields no stored tensor is named.
PREFIX_FIELDS = frozenset({"prefix_tokens", "branch_tokens", "prefix_of"})
_PREFIX, _BRANCH, _PREFIX_OF = (json_text(name) for name in ("prefix_tokens", "branch_tokens", "prefix_of"))
MAX_SHARES = 1 << 16  # the most shares a reader may cut an experience's tokens into
# Every field a columnar batch may have, in the order a refusal lists them: the tensors an
# experience stores (and a multimodal input, MM_PREFIX + its key), the columns of one value per
# experience, the version segments, and the prefix + branches form of the tokens.
FIELDS = (*TENSOR_FIELDS, *SCALARS, SEGMENTS, "prefix_tokens", "branch_tokens", "prefix_of")
_FIELDS = frozenset(FIELDS)


def unknown_field(fields: Iterable[str]) -> str | None:
    """What is wrong with a columnar read's `fields`, naming the first that no column could be
    and the fields there are; None when every one is a field (which a batch may yet lack: a
    reply names those in `missing_fields`). A typo would otherwise read no column at all."""
    for name in fields:
        if name not in _FIELDS and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
            return f"unknown field {name[:70]!r}; the fields are {', '.join(FIELDS)}, and {MM_PREFIX}KEY"
    return None


Rows = list[tuple[int, int]]  # runs of a tensor's rows (along its first dimension), each start to end
Entry = tuple[bytes, bytes, bytes, int, int]  # a stored tensor: name, dtype, dimensions, start, end


@dataclass(frozen=True, slots=True)
class Shares:
    """A reader's part of each experience's token positions: of `count` equal runs of them (the
    run s of an experience of L tokens is positions L*s//count to L*(s+1)//count), those numbered
    in `take`, in that order. A context-parallel rank r of C takes share r of C, or, balanced as
    Megatron-LM's context parallelism splits a causal sequence, shares r and 2C-1-r of 2C.

    Each tensor an experience has along its tokens comes cut to the rows at those positions: one
    of its token count along its first dimension (`tokens`, routing ids, ...) at them, one of
    Trinity-RFT's response fields (`logprobs`, `action_mask`, `advantages`, ...) of its response
    length at those of them after the prompt; any other tensor (an image's pixels) whole."""

    count: int
    take: tuple[int, ...]
    # each share taken's place in `take`, made at the first experience of fewer tokens than shares taken
    placed: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARES:
            raise ValueError(f"shares: {self.count}; an experience's tokens are cut into 1 to {MAX_SHARES} shares")
        if not self.take:
            raise ValueError(f"shares: {self.count} given, but no share of them to take")
        wrong = [share for share in self.take if share >= self.count]
        if wrong:
            raise ValueError(f"take: share {wrong[0]} of {self.count} (shares are numbered 0 to {self.count - 1})")
        seen: set[int] = set()
        for share in self.take:
            if share in seen:
                raise ValueError(f"take: share {share} named twice")
            seen.add(share)

    def positions(self, length: int) -> Rows:
        """The runs of positions of an experience of `length` tokens that the shares taken cover, in
        the order taken; a share that covers none (more shares than tokens) is left out, so that a
        read's work goes with the tokens it reads, not with the shares it names (65,536 shares of
        each small experience cost a request seconds of the server's CPU)."""
        count = self.count
        if len(self.take) <= length:
            runs = [(length * share // count, length * (share + 1) // count) for share in self.take]
            return [(a, b) for a, b in runs if a < b]
        if not self.placed:
            self.placed.update((share, at) for at, share in enumerate(self.take))
        # token t is in share ceil((t + 1) * count / length) - 1: each share that holds a token, once
        held = {((t + 1) * count + length - 1) // length - 1 for t in range(length)}
        taken = sorted((self.placed[share], share) for share in held if share in self.placed)
        return [(length * share // count, length * (share + 1) // count) for _, share in taken]

    def rows(self, name: bytes, rows: int, length: int | None, response: int) -> Rows | None:
        """The runs of rows of an experience's tensor `name` (as a stored header writes it), of
        `rows` rows, in the shares taken, where the experience has `length` tokens (None: no
        tokens) and `response` of them after its prompt; None for a tensor kept whole."""
        if length is None:
            return None
        if name in _RESPONSE and rows == response:
            prompt = length - response
            runs = [(max(a - prompt, 0), max(b - prompt, 0)) for a, b in self.positions(length)]
            return [(a, b) for a, b in runs if a < b]
        return self.positions(length) if rows == length else None

    def spans(self, found: Sequence[Entry], names: Collection[bytes], response: int) -> Rows:
        """The bytes of an experience's section (its stored tensors, `found`) that the columns of
        `names` read: the whole of a tensor kept whole, its rows in the shares of one cut."""
        length = token_count(found)
        spans: Rows = []
        for name, _, dims, start, end in found:
            if name not in names:
                continue
            shape = _shape(dims)
            runs = self.rows(name, shape[0], length, response) if shape else None
            if runs is None:
                spans.append((start, end))
            else:
                width = (end - start) // shape[0] if shape[0] else 0
                spans += [(start + a * width, start + b * width) for a, b in runs]
        return spans


def token_count(found: Sequence[Entry]) -> int | None:
    """How many tokens a stored experience has (its `tokens`' first dimension), None without them."""
    for name, _, dims, _, _ in found:
        if name == _TOKENS:
            shape = _shape(dims)
            return shape[0] if shape else None
    return None


def _shape(dims: bytes) -> tuple[int, ...]:
    return tuple(map(int, dims.split(b","))) if dims else ()


def _cut_rows(
    runs: Rows, shape: tuple[int, ...], data: Section, start: int, end: int
) -> tuple[tuple[int, ...], list[Run]]:
    """A tensor's rows in `runs` as the views of `data` (its section; the tensor is bytes start to
    end of it) they span, and the shape they make."""
    width = (end - start) // shape[0] if shape[0] else 0
    pieces = [piece for a, b in runs for piece in cut(data, start + a * width, start + b * width)]
    return (sum(b - a for a, b in runs), *shape[1:]), pieces


@dataclass
class ColumnParts:
    """One column of a batch: the experiences (`items`, batch positions) whose `name` tensor has
    this dtype and rank, their shapes (`ndim` numbers each, flattened) and their bytes as runs."""

    name: str
    dtype: str
    ndim: int
    items: list[int] = field(default_factory=list)
    shapes: list[int] = field(default_factory=list)
    values: list[Run] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Its values' bytes, counted in a compiled loop: `sum(map(len, ...))` calls `len` through the
        interpreter and adds boxed ints, some 380 instructions a value."""
        total = 0
        for value in self.values:
            total += len(value)
        return total


def column_parts(
    payloads: Iterable[Stored],
    fields: Sequence[str],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
    added: Sequence[str] = (),
    shares: Shares | None = None,
    responses: Sequence[int] = (),
) -> list[ColumnParts]:
    """The columns of `fields` over stored one-item payloads, in the order `fields` names them
    (each field's columns in the order their first experience comes). `extra(i, tensors)`
    gives tensors that item i gets on top of its stored ones (the server's advantages), only
    those named in `added`; it is called only when one of them is asked for. With `shares`,
    each tensor laid along the tokens is cut to them, item i's response being `responses[i]`
    tokens long.

    Gathered a run of items at a time (`_runs`: consecutive items of one stored header, most of a
    batch): each stored tensor's column takes the run's positions, shapes and views in one step
    each, so that what an experience costs is a view of each field, not the Python of a lookup, a
    key and a call. Only what differs item by item goes one item at a time: a tensor `extra` may
    give, the rows of the shares, the prefix + branches form."""
    gathering = _Gathering(fields, extra if extra is not None and set(fields) & set(added) else None, added)
    for read, first, sections in _runs(payloads):
        gathering.run(read, first, sections, shares, responses)
    return in_order(gathering.columns.values(), fields)


class _Gathering:
    """A batch's columns as its runs of items are gathered into them (column_parts)."""

    __slots__ = ("columns", "extra", "given", "texts", "tree", "wanted")

    def __init__(
        self,
        fields: Sequence[str],
        extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None,
        added: Sequence[str],
    ) -> None:
        self.wanted = {json_text(name): name for name in fields}  # as the stored headers write them
        self.texts = {name: text for text, name in self.wanted.items()}
        self.extra = extra  # None where no field it may give is asked for
        # the tensors gathered one item at a time: those `extra` may give in a stored one's place
        self.given = frozenset(json_text(name) for name in added) if extra is not None else frozenset()
        self.tree = _Tree() if PREFIX_FIELDS & set(fields) else None
        self.columns: dict[tuple[bytes, bytes, int], ColumnParts] = {}

    def run(
        self, read: HeaderRead, first: int, sections: list[Section], shares: Shares | None, responses: Sequence[int]
    ) -> None:
        """A run of items of one header (`read`), the first at batch position `first`: in one step
        for the whole run, each stored tensor sent whole that `extra` may not replace; the rest
        item by item."""
        wanted = self.wanted
        entries = [(entry, named[2]) for entry, named in zip(read.found, read.named, strict=True) if entry[0] in wanted]
        if shares is None:
            count = len(sections)
            for (text, dtype, _, start, end), shape in entries:
                if text not in self.given:
                    column = _column(self.columns, wanted, text, dtype, len(shape))
                    column.items.extend(range(first, first + count))
                    column.shapes.extend(shape * count)
                    column.values.extend(_views(sections, start, end))
            if self.extra is None and self.tree is None:
                return
            entries = [entry for entry in entries if entry[0][0] in self.given]
        for index, section in enumerate(sections, first):
            cuts = _Cuts(shares, token_count(read.found), responses[index]) if shares is not None else None
            self.item(index, read, entries, section, cuts)
            if self.tree is not None:
                self.tree.add(self.columns, wanted, index, read.found, section, responses[index])

    def item(
        self,
        index: int,
        read: HeaderRead,
        entries: Sequence[tuple[Entry, tuple[int, ...]]],
        section: Section,
        cuts: _Cuts | None,
    ) -> None:
        """Item `index`'s stored tensors of `entries` into their columns, each as it is or cut to
        the shares (`cuts`), or what `extra` gives in its place; then what `extra` gives that the
        item does not store."""
        columns, wanted = self.columns, self.wanted
        given = self.extra(index, read.tensors(section)) if self.extra is not None else {}
        for (text, dtype, _, start, end), shape in entries:
            tensor = given.get(wanted[text]) if given else None
            if tensor is not None:  # replaced: in the stored one's place
                _computed(columns, wanted, index, text, tensor, cuts)
            elif cuts is None:
                _add(columns, wanted, index, (text, dtype), shape, cut(section, start, end))
            else:
                _add(columns, wanted, index, (text, dtype), *cuts.stored(text, shape, section, start, end))
        for name, tensor in given.items():
            field_text = self.texts.get(name)  # a field asked for, as the stored headers write it
            if field_text is not None and name not in read.by_name:
                _computed(columns, wanted, index, field_text, tensor, cuts)


def _runs(payloads: Iterable[Stored]) -> Iterator[tuple[HeaderRead, int, list[Section]]]:
    """The payloads as runs of consecutive items of one stored header and section length, their
    sections all views or all in pieces: each run's header read (once a batch for each header:
    HeaderReads), the batch position of its first item, and its items' tensor sections."""
    headers = HeaderReads()
    run: list[Section] = []
    read: HeaderRead | None = None
    first = 0
    # the run's header, section length and whether its sections are views: compared one by one, where
    # a tuple of them was made and compared for each item
    last_header, last_len, last_view = b"", -1, False
    for index, payload in enumerate(payloads):
        header, section, section_len, _ = located(payload)
        view = type(section) is VIEW
        if section_len != last_len or view != last_view or header != last_header:
            if read is not None:
                yield read, first, run
            read, first, run = headers.read(header, section_len), index, []
            last_header, last_len, last_view = header, section_len, view
        run.append(section)
    if read is not None:
        yield read, first, run


def _views(sections: list[Section], start: int, end: int) -> list[Run]:
    """Bytes `start` to `end` of each of a run's sections, as the views of them they span."""
    if type(sections[0]) is memoryview:  # then all are (_runs), which mypy cannot know
        return [section[start:end] for section in sections]  # type: ignore[misc]
    return [piece for section in sections for piece in cut(section, start, end)]


class _Tree:
    """The prefix + branches form of a batch (PREFIX_FIELDS), as tree packing takes it: each
    distinct prompt once (`prefix_tokens`, in the row of the first experience that has it), each
    experience's tokens after its prompt (`branch_tokens`) and the batch position of the
    experience whose prefix it continues (`prefix_of`). Prompts are the same when their bytes
    and dtype are."""

    def __init__(self) -> None:
        self.seen: dict[tuple[bytes, bytes], int] = {}

    def add(
        self,
        columns: dict[tuple[bytes, bytes, int], ColumnParts],
        wanted: dict[bytes, str],
        index: int,
        found: Sequence[Entry],
        section: Section,
        response: int,
    ) -> None:
        for name, dtype, dims, start, end in found:
            shape = _shape(dims)
            if name != _TOKENS or not shape or not 0 <= response <= shape[0]:
                continue
            width = (end - start) // shape[0] if shape[0] else 0
            split = start + (shape[0] - response) * width
            prompt = cut(section, start, split)
            owner = self.seen.setdefault((dtype, bytes(joined(prompt))), index)
            if owner == index and _PREFIX in wanted:
                _add(columns, wanted, index, (_PREFIX, dtype), (shape[0] - response, *shape[1:]), prompt)
            if _BRANCH in wanted:
                _add(columns, wanted, index, (_BRANCH, dtype), (response, *shape[1:]), cut(section, split, end))
            if _PREFIX_OF in wanted:
                key = (_PREFIX_OF, b"I64", 0)
                column = columns.get(key) or columns.setdefault(key, ColumnParts("prefix_of", "I64", 0))
                column.items.append(index)
                column.values.append(struct.pack("<q", owner))
            return


@dataclass(slots=True)
class _Cuts:
    """Shares applied to one experience of `length` tokens, `response` of them after its prompt."""

    shares: Shares
    length: int | None
    response: int

    def stored(
        self, name: bytes, shape: tuple[int, ...], section: Section, start: int, end: int
    ) -> tuple[tuple[int, ...], list[Run]]:
        """A stored tensor's shape and bytes in the shares (whole where it is kept whole)."""
        runs = self.shares.rows(name, shape[0], self.length, self.response) if shape else None
        if runs is None:
            return shape, cut(section, start, end)
        return _cut_rows(runs, shape, section, start, end)

    def given(self, name: bytes, tensor: RawTensor) -> RawTensor:
        """A computed tensor in the shares."""
        runs = self.shares.rows(name, tensor.shape[0], self.length, self.response) if tensor.shape else None
        if runs is None:
            return tensor
        shape, pieces = _cut_rows(runs, tensor.shape, memoryview(tensor.data), 0, len(tensor.data))
        return RawTensor(tensor.dtype, shape, bytes(joined(pieces)))


def _computed(
    columns: dict[tuple[bytes, bytes, int], ColumnParts],
    wanted: dict[bytes, str],
    index: int,
    text: bytes,
    tensor: RawTensor,
    cuts: _Cuts | None,
) -> None:
    """Item `index`'s tensor that the caller's `extra` gave (a computed advantage) into its
    column, cut to the shares (`cuts`) where there are some."""
    if cuts is not None:
        tensor = cuts.given(text, tensor)
    _add(columns, wanted, index, (text, tensor.dtype.encode()), tensor.shape, [tensor.data])


def _add(
    columns: dict[tuple[bytes, bytes, int], ColumnParts],
    wanted: dict[bytes, str],
    index: int,
    entry: tuple[bytes, bytes],
    shape: tuple[int, ...],
    data: list[Run],
) -> None:
    """Item `index`'s tensor (its name and dtype as its header writes them, and the shape of
    what is sent of it) into the column of its field, dtype and rank."""
    column = _column(columns, wanted, *entry, len(shape))
    column.items.append(index)
    column.shapes.extend(shape)
    column.values.extend(data)


def _column(
    columns: dict[tuple[bytes, bytes, int], ColumnParts], wanted: dict[bytes, str], text: bytes, dtype: bytes, ndim: int
) -> ColumnParts:
    """The column of a field (`text`, as its header writes it), dtype and rank, made when first met."""
    key = (text, dtype, ndim)
    column = columns.get(key)
    if column is None:
        column = columns[key] = ColumnParts(wanted[text], dtype.decode(), ndim)
    return column


def scalar_column(name: str, values: Sequence[float | int | None]) -> ColumnParts | None:
    """The column of one value per experience of `name` (one of SCALARS), of the experiences
    that have one; None when none has."""
    dtype = SCALARS[name]
    items = [index for index, value in enumerate(values) if value is not None]
    if not items:
        return None
    data = struct.pack(_PACK[dtype] % len(items), *[values[index] for index in items])
    return ColumnParts(name, dtype, 0, items, [], [data])


def segment_column(segments: Sequence[Sequence[int]], versions: Sequence[int | None]) -> ColumnParts | None:
    """The column of each experience's version segments, named as its info names them,
    [k, 2] int64: a row (version, offset) per segment it was pushed with, or one of its version at
    offset 0; an experience with neither is left out, and the column is None when every one is."""
    rows = [
        tuple(flat) or ((version, 0) if version is not None else ())
        for flat, version in zip(segments, versions, strict=True)
    ]
    items = [index for index, flat in enumerate(rows) if flat]
    if not items:
        return None
    shapes = [number for index in items for number in (len(rows[index]) // 2, 2)]
    values: list[Run] = [struct.pack(f"<{len(rows[index])}q", *rows[index]) for index in items]
    return ColumnParts(SEGMENTS, "I64", 2, items, shapes, values)


def in_order(columns: Iterable[ColumnParts], fields: Sequence[str]) -> list[ColumnParts]:
    """Columns in the order `fields` names them (a stable sort: a field's columns keep theirs)."""
    rank = {name: at for at, name in enumerate(fields)}
    return sorted(columns, key=lambda column: rank[column.name])
