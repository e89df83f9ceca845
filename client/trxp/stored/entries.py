"""A spliced batch's safetensors header, its entries written a run of items at a time.

Most of a batch's items share a layout: the same tensors, dtypes and shapes, so the same entry
texts, only their item index and offsets differing. Formatting each entry alone costs a call, and
its start offset is the end offset of the entry before formatted a second time; an int's decimal
text is most of what an entry costs. Here the items of one layout that come one after another are
written by one `%` over a template repeated for each, its numbers laid out in C (`zip` of
`range`s), with no Python step for each item or entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, repeat

_AT = b'"%d:'  # an entry's item index, before its text (a stored entry's from its name to its start offset)
_SPAN = b"%d,%d]}"  # its start and end offsets, after it


class Layout:
    """The entries of an item of one layout: each entry's text (from its name to its start offset,
    as a stored header writes it) and its start and end offsets in the item's tensor bytes, which
    are `size` bytes long; the names of its tensors (those it stores, where it is a stored one),
    and the layouts it makes with tensors added after its own, by what is added (None where an
    added tensor would replace one of its own), as a batch's items meet them."""

    __slots__ = ("added", "names", "size", "spans", "template", "texts")

    def __init__(
        self, texts: list[bytes], spans: list[tuple[int, int]], size: int, names: frozenset[str] = frozenset()
    ) -> None:
        self.texts, self.spans, self.size, self.names = texts, spans, size, names
        self.added: dict[tuple[object, ...], Layout | None] = {}  # by each added tensor's name, dtype, shape, size
        self.template = b",".join([_AT + text.replace(b"%", b"%%") + _SPAN for text in texts])


class Entries:
    """The entries of a batch's header in item order: an item's as it comes (`add`), or those of a run
    of items of one layout, each after the one before it: the run's first `start`s it, each next
    adds one to its `count` (no call: an item costs what it must), and its entries are written when
    the run ends."""

    __slots__ = ("_base", "_first", "count", "layout", "written")

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.layout: Layout | None = None
        self._first = self._base = self.count = 0

    def add(self, entry: bytes) -> None:
        """One entry written as it is, after those before it."""
        if self.layout is not None:
            self._flush()
        self.written.append(entry)

    def start(self, layout: Layout, index: int, base: int) -> None:
        """A run of items of `layout` from item `index`, its tensor bytes starting at `base` in the batch's."""
        if self.layout is not None:
            self._flush()
        self.layout, self._first, self._base, self.count = layout, index, base, 1

    def header(self) -> bytes:
        """The batch's safetensors header: its entries, in order, as one JSON object."""
        if self.layout is not None:
            self._flush()
        return b"{" + b",".join(self.written) + b"}"

    def _flush(self) -> None:
        layout, first, base, count = self.layout, self._first, self._base, self.count
        assert layout is not None
        self.layout = None
        indices, step = range(first, first + count), layout.size
        numbers: list[Iterable[int]] = []
        for start, end in layout.spans:
            numbers += (indices, _steps(base + start, step, count), _steps(base + end, step, count))
        self.written.append(
            b",".join([layout.template] * count) % tuple(chain.from_iterable(zip(*numbers, strict=True)))
        )


def _steps(first: int, step: int, count: int) -> Iterable[int]:
    """`count` numbers from `first`, `step` apart (a layout's tensors may be empty: step 0)."""
    return range(first, first + count * step, step) if step else repeat(first, count)
