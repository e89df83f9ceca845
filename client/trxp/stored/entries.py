"""A spliced batch's safetensors header, its entries written a run of items at a time.

Most of a batch's items share a layout: the same tensors, dtypes and shapes, so the same entry
texts, only their item index and offsets differing. Formatting each entry alone costs a call, and
its start offset is the end offset of the entry before formatted a second time; an int's decimal
text is most of what an entry costs. Here the items of one layout that come one after another are
written by one `%` over a template repeated for each, its numbers laid out in C (`range`s
assigned to slices of one list), with no Python step for each item or entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from ..codec.build import ENTRY_AT, ENTRY_SPAN

_ONE = ENTRY_AT + b"%b" + ENTRY_SPAN  # an entry written alone, its text (from its name to its start offset) given


class Layout:
    """The entries of an item of one layout: each entry's text (from its name to its start offset,
    as a stored header writes it) and its start and end offsets in the item's tensor bytes, which
    are `size` bytes long; the layouts it makes with tensors added after its own, by what is added
    (None where an added tensor would replace one of its own), as a batch's items meet them. Made
    for each stored header a batch has, which in a batch of varied lengths is each item's: what a
    run of one item does not need (its template, its names) is made when first asked for."""

    __slots__ = ("_template", "added", "entries", "names", "size")

    def __init__(self, entries: list[tuple[bytes, int, int]], size: int) -> None:
        self.entries, self.size = entries, size  # each entry's text, start and end
        self.added: dict[tuple[object, ...], Layout | None] = {}  # by each added tensor's name, dtype, shape, size
        self.names: frozenset[bytes] | None = None  # its tensors' names as JSON text, once asked for
        self._template = b""

    @property
    def template(self) -> bytes:
        """Its entries as one `%` template: item index, start and end offset of each, in order."""
        if not self._template:
            self._template = b",".join(
                [ENTRY_AT + text.replace(b"%", b"%%") + ENTRY_SPAN for text, _, _ in self.entries]
            )
        return self._template


class Entries:
    """The entries of a batch's header in item order: an item's as it comes (onto `written`, once
    the run before it is flushed), or those of a run of items of one layout, each after the one
    before it: the run's first `start`s it, each next adds one to its `count` (no call: an item
    costs what it must), and its entries are written when the run ends; an item alone (`one`) has
    its entries written as they come."""

    __slots__ = ("_base", "_first", "count", "layout", "written")

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.layout: Layout | None = None
        self._first = self._base = self.count = 0

    def start(self, layout: Layout, index: int, base: int) -> None:
        """A run of items of `layout` from item `index`, its tensor bytes starting at `base` in the batch's."""
        if self.layout is not None:
            self.flush()
        self.layout, self._first, self._base, self.count = layout, index, base, 1

    def one(self, layout: Layout, index: int, base: int) -> None:
        """Item `index`'s entries, of `layout`, written as they come (a run of one spares nothing)."""
        if self.layout is not None:
            self.flush()
        for text, start, end in layout.entries:
            self.written.append(_ONE % (index, text, base + start, base + end))

    def header(self) -> bytes:
        """The batch's safetensors header: its entries, in order, as one JSON object."""
        if self.layout is not None:
            self.flush()
        return b"{" + b",".join(self.written) + b"}"

    def flush(self) -> None:
        """The run's entries written: before an item's entries written as they come (`written`)."""
        layout, first, base, count = self.layout, self._first, self._base, self.count
        assert layout is not None
        self.layout = None
        indices, step = range(first, first + count), layout.size
        numbers: list[Iterable[int]] = []
        for _, start, end in layout.entries:
            numbers += (indices, _steps(base + start, step, count), _steps(base + end, step, count))
        # the template's numbers item by item: each entry's column of them laid into its places of
        # one list (a slice assignment, in C), not a tuple an item zipped and chained
        width = len(numbers)
        values: list[int] = [0] * (width * count)
        for at, column in enumerate(numbers):
            values[at::width] = column
        self.written.append(b",".join([layout.template] * count) % tuple(values))


def _steps(first: int, step: int, count: int) -> Iterable[int]:
    """`count` numbers from `first`, `step` apart (a layout's tensors may be empty: step 0)."""
    return range(first, first + count * step, step) if step else repeat(first, count)
