"""Batches spliced from the payloads the server stored (pack_item's), without unpickling them:
each item's metadata opcodes and tensor bytes copied as they are (or handed on as runs of bytes,
uncopied, for a caller that frames the batch), and only the safetensors header rewritten; and the
stored items' tensors read from their headers, without a JSON parse, for the columns of a reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from ..codec.build import ENTRY, SPLICE_ONE, SPLICE_TAIL, build, frame, json_text, splice_meta
from ..codec.common import RawTensor
from ..codec.parse import parse
from .pieces import Run, Section, SectionTensors, Stored, cut, parts_of, realized, whole


def join(
    payloads: Iterable[bytes],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
) -> bytes:
    """Concatenate payloads the server stored (already validated) into one batch.

    Payloads made by pack_item are spliced: their metadata opcodes and tensor bytes are
    copied as they are, and only the safetensors header is rewritten. `extra(i, tensors)`
    may add or replace tensors of item i (the server attaches advantages this way).
    Payloads of any other layout are parsed and rebuilt.
    """
    return b"".join([realized(run) for run in join_parts(payloads, extra)])


def join_parts(
    payloads: Iterable[Stored],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
    drop: Collection[str] = (),
) -> list[Run]:
    """join()'s batch as the runs of bytes it is made of, uncopied: a caller that frames
    the batch (in a reply message, say) copies each byte once. Tensors named in `drop`
    are left out of every item (the server sends advantages beside a batch this way).

    The batch's safetensors header is written entry by entry, the same bytes as json.dumps
    of it; the stored headers are read by `_stored_tensors`, without a JSON parse."""
    payloads = list(payloads)
    dropped = {json_text(name) for name in drop}
    fragments: list[memoryview] = []
    entries: list[bytes] = []
    data: list[Run] = []
    base = 0
    for index, payload in enumerate(payloads):
        meta, header, section, section_len = parts_of(payload)
        if meta[: len(SPLICE_ONE)] != SPLICE_ONE or meta[-len(SPLICE_TAIL) :] != SPLICE_TAIL:
            return [_rebuild(payloads, extra, drop)]
        fragments.append(meta[len(SPLICE_ONE) : -len(SPLICE_TAIL)])
        stored, whole = _stored_tensors(header, section_len)
        if dropped and any(t[0] in dropped for t in stored):
            stored = [t for t in stored if t[0] not in dropped]
            whole = False
        if whole and extra is None:  # the section as it is, its offsets moved by base
            entries.extend(
                [ENTRY % (index, name, dtype, shape, base + a, base + b) for name, dtype, shape, a, b in stored]
            )
            _extend(data, section)
            base += section_len
            continue
        added: dict[str, RawTensor] = {}
        if extra is not None:
            added = extra(index, stored_tensors(stored, section))
        kept = [t for t in stored if _json_name(t[0]) not in added] if added else stored
        # Tensors kept whole are copied as one run of bytes; a replaced one leaves a gap.
        if whole and len(kept) == len(stored):
            _extend(data, section)
        elif isinstance(section, memoryview):
            data.extend([section[t[3] : t[4]] for t in kept])
        else:
            data.extend([run for t in kept for run in cut(section, t[3], t[4])])
        for name, dtype, shape, start, end in kept:
            entries.append(ENTRY % (index, name, dtype, shape, base, base + end - start))
            base += end - start
        for key, tensor in added.items():
            dims = b",".join([b"%d" % dim for dim in tensor.shape])
            entries.append(
                ENTRY % (index, json_text(key), json_text(tensor.dtype), dims, base, base + len(tensor.data))
            )
            base += len(tensor.data)
            data.append(tensor.data)
    return [*frame([splice_meta(fragments)], b"{" + b",".join(entries) + b"}", [], data_len=base), *data]


_INT = rb"(?:0|[1-9][0-9]*)"
# One entry of a stored header as pack_item writes it (through json.dumps): item index 0.
_STORED_ENTRY = (
    rb'"0:([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[((?:' + _INT + rb")(?:," + _INT + rb")*)?\],"
    rb'"data_offsets":\[(' + _INT + rb"),(" + _INT + rb")\]\}"
)
_STORED_ENTRIES = re.compile(_STORED_ENTRY)
_STORED_HEADER = re.compile(rb"\{(?:(?:" + _STORED_ENTRY + rb")(?:,(?:" + _STORED_ENTRY + rb"))*)?\} *")
# A tensor of a stored header: name, dtype and shape as JSON text, start and end offsets.
_Stored = tuple[bytes, bytes, bytes, int, int]


def _stored_tensors(header: bytes, section_len: int) -> tuple[list[_Stored], bool]:
    """The tensors of one stored item's safetensors header in order, and whether they lie
    back to back from the start to the end of its tensor section.

    pack_item writes `{"0:name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},...}` padded
    with spaces: two passes of regular expressions read it, the first checking every byte.
    A header in any other layout is parsed as JSON."""
    if _STORED_HEADER.fullmatch(header) is None:
        return _parsed_tensors(header, section_len)
    found: list[_Stored] = []
    end = 0
    whole = True
    for name, dtype, shape, first, last in _STORED_ENTRIES.findall(header):
        start = int(first)
        whole = whole and start == end
        end = int(last)
        found.append((name, dtype, shape, start, end))
    return found, whole and end == section_len


def stored_entries(header: bytes, section_len: int) -> list[tuple[bytes, bytes, bytes, int, int]]:
    """One stored item's tensors as its safetensors header writes them: name and dtype as the
    contents of JSON strings, dimensions as JSON text, start and end offsets in its section."""
    return _stored_tensors(header, section_len)[0]


def stored_tensors(found: list[_Stored], section: Section) -> Mapping[str, RawTensor]:
    """One stored item's tensors (its `stored_entries`) by name, as views of its tensor section,
    or, for a section in pieces, made as each is looked up (pieces.SectionTensors)."""
    if isinstance(section, memoryview):
        return {
            _json_name(name): RawTensor(dtype.decode(), _shape(shape), section[start:end])
            for name, dtype, shape, start, end in found
        }
    entries = {_json_name(name): (dtype.decode(), _shape(shape), a, b) for name, dtype, shape, a, b in found}
    return SectionTensors(entries, section)


def _json_name(text: bytes) -> str:
    """A name as the contents of a JSON string, read back."""
    return json.loads(b'"' + text + b'"') if b"\\" in text else text.decode()


def _parsed_tensors(header: bytes, section_len: int) -> tuple[list[_Stored], bool]:
    """_stored_tensors() of a header in another layout, through a JSON parse."""
    found: list[_Stored] = []
    end = 0
    whole = True
    for key, entry in json.loads(header).items():
        if key == "__metadata__":
            continue
        start, stop = entry["data_offsets"]
        whole = whole and start == end
        end = stop
        shape = b",".join([b"%d" % dim for dim in entry["shape"]])
        found.append((json_text(key.partition(":")[2]), json_text(entry["dtype"]), shape, start, stop))
    return found, whole and end == section_len


def _extend(data: list[Run], section: Section) -> None:
    """A whole section onto a payload's runs: one run, or its pieces."""
    if isinstance(section, memoryview):
        data.append(section)
    else:
        data.extend(section)


def _shape(text: bytes) -> tuple[int, ...]:
    return tuple(map(int, text.split(b","))) if text else ()


def _rebuild(
    payloads: Sequence[Stored],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None,
    drop: Collection[str],
) -> bytes:
    items = [item for payload in payloads for item in parse(whole(payload), trusted=True)]
    for index, item in enumerate(items):
        for name in drop:
            item.tensors.pop(name, None)
        if extra:
            item.tensors.update(extra(index, item.tensors))
    return build(items)
