"""Batches spliced from the payloads the server stored (pack_item's), without unpickling them:
each item's metadata opcodes and tensor bytes copied as they are (or handed on as runs of bytes,
uncopied, for a caller that frames the batch), and only the safetensors header rewritten; and the
stored items' tensors read from their headers, without a JSON parse, for the columns of a reply.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final, NamedTuple

from ..codec.build import ENTRY, ENTRY_TEXT, SPLICE_ONE, SPLICE_TAIL, build, dims_text, frame, json_text, splice_meta
from ..codec.common import HEADER_SIZE, RawTensor
from ..codec.parse import parse
from .entries import Entries, Layout
from .pieces import VIEW, Bytes, Run, Section, SectionTensors, SplitPayload, Stored, concatenated, cut, parts_of, whole


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
    return concatenated(join_parts(payloads, extra))


def join_parts(
    payloads: Iterable[Stored],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
    drop: Collection[str] = (),
) -> list[Run]:
    """join()'s batch as the runs of bytes it is made of, uncopied: a caller that frames
    the batch (in a reply message, say) copies each byte once. Tensors named in `drop`
    are left out of every item (the server sends advantages beside a batch this way).

    The batch's safetensors header is written entry by entry, the same bytes as json.dumps
    of it, and no stored header is parsed as JSON where pack_item wrote it. An item stored as
    pack_item writes it (its tensors back to back over its whole section, none dropped or
    replaced) keeps each entry's text as its header writes it up to the offsets, read in one pass
    (`_back_to_back`) once a batch for each header, with the tensors `extra` adds after them
    (entries.Layout); the items of one layout that come one after another have their entries
    written in one step (entries.Entries), only their indices and offsets differing. Any other
    item's tensors are read by `_stored_tensors`."""
    payloads = list(payloads)
    fragments: list[Bytes] = []
    entries = Entries()
    written = entries.written  # the entries of items written as they come, after any run's (entries.flush)
    data: list[Run] = []
    base = 0
    dropped = frozenset(json_text(name) for name in drop)
    pattern = _back_to_back(parts=False, dropped=dropped) if dropped else _AS_STORED
    layouts: dict[bytes, Layout | None] = {}  # by stored header: a batch's items mostly share one
    headers = HeaderReads(dropped)
    last_header = b""  # the stored header of the item before
    stored: Layout | None = None  # its layout, where it had one: an item stored alike has the same
    for index, payload in enumerate(payloads):
        read = _spliced(payload)
        if read is None:
            meta, header, section, section_len = parts_of(payload)
            if meta[: len(SPLICE_ONE)] != SPLICE_ONE or meta[-len(SPLICE_TAIL) :] != SPLICE_TAIL:
                return [_rebuild(payloads, extra, drop)]
            fragments.append(meta[len(SPLICE_ONE) : -len(SPLICE_TAIL)])
            read_once = headers.read(header, section_len)
            added = extra(index, read_once.tensors(section)) if extra is not None else {}
        else:
            fragment, header, section, section_len = read
            fragments.append(fragment)
            # An item stored as the one before continues a run (or starts one, the one before written
            # as it came); with tensors added, any other is written as it comes, its stored header
            # read for what it is given anyway.
            continues = header == last_header
            last_header = header
            if not continues or stored is None:  # else the layout of the item before, not looked up again
                stored = layouts.get(header)
            if stored is None and (extra is None or continues) and header not in layouts:
                stored = layouts[header] = _stored_layout(pattern, header)
            if stored is None or stored.size != section_len or not (extra is None or continues):
                read_once = headers.read(header, section_len)  # not as pack_item stores it, or gaps
                added = extra(index, read_once.tensors(section)) if extra is not None else {}
            else:  # its stored tensors back to back, as they are, then those added after them
                layout: Layout | None = stored
                if extra is not None:
                    read_once = headers.read(header, section_len)
                    added = extra(index, read_once.tensors(section))
                    if added:
                        layout = _with_added(stored, added)
                if layout is not None:
                    if layout is entries.layout:  # the next item of a run
                        entries.count += 1
                    elif continues:
                        entries.start(layout, index, base)
                    else:
                        entries.one(layout, index, base)
                    base += layout.size
                    if isinstance(section, list):  # a compiled check, where a memoryview's is a builtin's lookup
                        data.extend(section)
                    else:
                        data.append(section)
                    if extra is not None and added:
                        data.extend([tensor.data for tensor in added.values()])
                    continue
        if entries.layout is not None:
            entries.flush()
        stored_tensors, whole = read_once.found, read_once.whole
        kept = [t for t in stored_tensors if _json_name(t[0]) not in added] if added else stored_tensors
        # Tensors kept whole are copied as one run of bytes; a replaced one leaves a gap.
        if whole and len(kept) == len(stored_tensors):
            _extend(data, section)
        elif isinstance(section, memoryview):
            data.extend([section[t[3] : t[4]] for t in kept])
        else:
            data.extend([run for t in kept for run in cut(section, t[3], t[4])])
        for name, dtype, shape, start, end in kept:
            written.append(ENTRY % (index, name, dtype, shape, base, base + end - start))
            base += end - start
        for key, tensor in added.items():
            dims = dims_text(tensor.shape)
            written.append(
                ENTRY % (index, json_text(key), json_text(tensor.dtype), dims, base, base + len(tensor.data))
            )
            base += len(tensor.data)
            data.append(tensor.data)
    return [*frame([splice_meta(fragments)], entries.header(), [], data_len=base), *data]


def _stored_layout(pattern: re.Pattern[bytes], header: bytes) -> Layout | None:
    """The layout of an item stored with this header as pack_item writes it, its tensors back to back
    from the start of its section (`pattern`: _back_to_back(parts=False)); None for a header of
    another layout."""
    found = pattern.fullmatch(header)
    if found is None:
        return None
    groups = found.groups()
    entries: list[tuple[bytes, int, int]] = []
    start = 0
    for at in range(0, (found.lastindex or 0) - 1, 2):  # two groups an entry
        end = int(groups[at + 1])
        entries.append((groups[at], start, end))
        start = end
    return Layout(entries, start)


def _with_added(layout: Layout, added: Mapping[str, RawTensor]) -> Layout | None:
    """`layout` with the tensors `added` after its own; None where one of them replaces one of its own.
    Looked up by a flat tuple of each one's name, dtype, shape and size, made without a comprehension
    (a function made and called for each item)."""
    kinds: list[object] = []
    for key, tensor in added.items():
        kinds += (key, tensor.dtype, tensor.shape, len(tensor.data))
    shapes = tuple(kinds)
    known = layout.added.get(shapes)
    if known is None and shapes not in layout.added:
        known = layout.added[shapes] = _added(layout, added)
    return known


def _added(layout: Layout, added: Mapping[str, RawTensor]) -> Layout | None:
    """`layout` with tensors like those `added` after its own (_with_added)."""
    if layout.names is None:
        layout.names = frozenset([text.partition(b'"')[0] for text, _, _ in layout.entries])
    entries, end = list(layout.entries), layout.size
    for key, tensor in added.items():
        name = json_text(key)
        if name in layout.names:
            return None
        size = len(tensor.data)
        entries.append((ENTRY_TEXT % (name, json_text(tensor.dtype), dims_text(tensor.shape)), end, end + size))
        end += size
    return Layout(entries, end)


# A stored payload's TRXP header then the head of its metadata pickle, and the tail of the pickle
# then the length of its safetensors header, as pack_item lays them out for splicing. Final, as
# what `_spliced` reads for each item: compiled, a Final name is a C static, where any other
# module name is a lookup in the module's dict (nine an item, about 1,300 instructions).
_SPLICED_HEAD: Final = struct.Struct(f"<5xQ8x{len(SPLICE_ONE)}s")  # HEADER's metadata length, then the pickle's head
_SPLICED_TAIL: Final = struct.Struct(f"<{len(SPLICE_TAIL)}sQ")
_ONE: Final[bytes] = SPLICE_ONE
_TAIL: Final[bytes] = SPLICE_TAIL
_TAIL_AT: Final[int] = HEADER_SIZE - len(SPLICE_TAIL)  # the pickle's tail: this plus its metadata's length
_FRAGMENT_AT: Final[int] = HEADER_SIZE + len(SPLICE_ONE)  # where an item's own opcodes start
_HEADER_AT: Final[int] = len(SPLICE_TAIL) + 8  # its safetensors header: this past the pickle's tail


def _spliced(payload: Stored) -> tuple[bytes, bytes, Section, int] | None:
    """A stored payload laid out for splicing, read from its framing: its own metadata opcodes,
    its safetensors header, its tensor section and the section's length. None for a payload of
    another layout or too short to be read so: join_parts reads that one through parts_of.

    The opcodes and the header are cut from one copy of the payload's bytes before its section
    (a few hundred): a slice of bytes is a compiled step, where each slice of a memoryview makes
    a slice object and a view (about 550 instructions)."""
    if isinstance(payload, SplitPayload):
        head, pieces = payload.head, payload.pieces
    else:
        head, pieces = payload, None
    meta_len: int
    header_len: int
    first: bytes
    last: bytes
    try:
        meta_len, first = _SPLICED_HEAD.unpack_from(head)
        fragment_end = _TAIL_AT + meta_len
        last, header_len = _SPLICED_TAIL.unpack_from(head, fragment_end)
    except (struct.error, OverflowError):
        return None
    if first != _ONE or last != _TAIL or fragment_end < _FRAGMENT_AT:
        return None
    header_at = fragment_end + _HEADER_AT
    header_end = header_at + header_len
    before: bytes = bytes(head[:header_end])
    fragment, header = before[_FRAGMENT_AT:fragment_end], before[header_at:]
    if pieces is not None:
        return fragment, header, pieces, sum(map(len, pieces))
    section = (head if type(head) is VIEW else memoryview(head))[header_end:]
    return fragment, header, section, len(section)


def _extend(data: list[Run], section: Section) -> None:
    """A whole section onto a payload's runs: one run, or its pieces."""
    if isinstance(section, memoryview):
        data.append(section)
    else:
        data.extend(section)


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
_MOST = 12  # the most entries a header is read in one pass with; one of more takes two (_spaced_tensors)
_OWN_INT = rb"(?:0|[1-9][0-9]*+)"  # _INT, possessive
# An entry's name, dtype and dimensions, possessive.
_PARTS = (rb'[^"\\\x00-\x1f]*+', rb"[A-Z0-9_]++", rb"(?:" + _OWN_INT + rb"(?:," + _OWN_INT + rb")*+)?+")


@functools.lru_cache(maxsize=8)
def _back_to_back(parts: bool, dropped: frozenset[bytes] = frozenset()) -> re.Pattern[bytes]:
    """A stored header of 1 to _MOST entries, of the layout pack_item writes, its tensors back to
    back from the start of its section and none of them named in `dropped` (as JSON text), in one
    pass of a regular expression that checks every byte. Of each entry it captures its end offset
    and before it, with `parts`, its name, dtype and dimensions (as JSON text), else its text from
    its name to its start offset. An entry's start offset is 0, or the text of the end offset
    before it. No quantifier could give back what it takes (each is followed by a byte it does not
    take), so each takes possessively, keeping no place to return to."""
    name, dtype, dims = (b"(" + text + b")" for text in _PARTS) if parts else _PARTS
    if dropped:
        name = rb'(?!(?:%b)")' % b"|".join([re.escape(text) for text in sorted(dropped)]) + name
    text = name + rb'":\{"dtype":"' + dtype + rb'","shape":\[' + dims + rb'\],"data_offsets":\['
    text = text if parts else b"(" + text + b")"

    def entry(number: int) -> bytes:
        start = rb"(?P=end%d)" % (number - 1) if number else rb"0"
        return rb'"0:' + text + start + rb",(?P<end%d>" % number + _OWN_INT + rb")\]\}"

    def entries_from(number: int) -> bytes:
        """Entries `number` to _MOST - 1, each there only where the one before is."""
        return b"" if number == _MOST else rb"(?:," + entry(number) + entries_from(number + 1) + rb")?+"

    return re.compile(rb"\{" + entry(0) + entries_from(1) + rb"\} *+")


_AS_STORED = _back_to_back(parts=False)
_BACK_TO_BACK_PARTS = _back_to_back(parts=True)


def _stored_tensors(header: bytes, section_len: int) -> tuple[list[_Stored], bool]:
    """The tensors of one stored item's safetensors header in order, and whether they lie
    back to back from the start to the end of its tensor section."""
    match = _BACK_TO_BACK_PARTS.fullmatch(header)
    if match is None:
        return _spaced_tensors(header, section_len)
    texts, last = match.groups(), match.lastindex or 0
    found: list[_Stored] = []
    start = at = 0
    while at < last:
        end = int(texts[at + 3])
        found.append((texts[at], texts[at + 1], texts[at + 2], start, end))
        start, at = end, at + 4
    return found, start == section_len


def _spaced_tensors(header: bytes, section_len: int) -> tuple[list[_Stored], bool]:
    """_stored_tensors() of a header `_BACK_TO_BACK_PARTS` does not read.

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


# One stored item's tensors read back: name, dtype, shape, start and end in its section.
_Named = list[tuple[str, str, tuple[int, ...], int, int]]


class HeaderRead(NamedTuple):
    """A stored header as a batch's items read it (`HeaderReads`): its tensors (`stored_entries`),
    whether they lie back to back over the whole section, the same tensors read back (names
    and dtypes as text, shapes as ints), and those by name (dtype, shape, start, end)."""

    found: list[_Stored]
    whole: bool
    named: _Named
    by_name: dict[str, tuple[str, tuple[int, ...], int, int]]

    def tensors(self, section: Section) -> Mapping[str, RawTensor]:
        """The tensors of an item with this header by name, each made as it is looked up
        (pieces.SectionTensors): the server's advantages read an item's action mask alone."""
        return SectionTensors(self.by_name, section)


class HeaderReads:
    """The stored headers of one batch, each read once: a batch's items mostly share one header's
    bytes (the same fields, dtypes and shapes), which a regular expression and the reads of its
    names and shapes would otherwise go over again for each item. The tensors named in `dropped`
    (as JSON text) are left out of every item's (join_parts' `drop`)."""

    __slots__ = ("_dropped", "_read")

    def __init__(self, dropped: frozenset[bytes] = frozenset()) -> None:
        self._dropped = dropped
        self._read: dict[tuple[bytes, int], HeaderRead] = {}

    def read(self, header: bytes, section_len: int) -> HeaderRead:
        """The header of an item whose tensor section is `section_len` bytes, its dropped tensors
        left out (and then not whole)."""
        key = (header, section_len)
        known = self._read.get(key)
        if known is None:
            found, whole = _stored_tensors(header, section_len)
            if self._dropped and any(t[0] in self._dropped for t in found):
                found, whole = [t for t in found if t[0] not in self._dropped], False
            named = _named(found)
            by_name = {name: (dtype, shape, a, b) for name, dtype, shape, a, b in named}
            known = self._read[key] = HeaderRead(found, whole, named, by_name)
        return known


def _named(found: list[_Stored]) -> _Named:
    return [(_json_name(name), dtype.decode(), _shape(shape), a, b) for name, dtype, shape, a, b in found]


_BACKSLASH = ord("\\")  # asked as an int: `bytes in bytes` first fails to read it as one, at some 1,800 instructions


def _json_name(text: bytes) -> str:
    """A name as the contents of a JSON string, read back."""
    return json.loads(b'"' + text + b'"') if _BACKSLASH in text else text.decode()


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
        shape = dims_text(entry["shape"])
        found.append((json_text(key.partition(":")[2]), json_text(entry["dtype"]), shape, start, stop))
    return found, whole and end == section_len


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
