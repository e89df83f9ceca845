"""The expansion bound's measure of a payload's metadata: how deep each item's metadata nests
and how many bytes it takes written out in full, as the store packs each experience.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Final

from .common import (
    CONTAINERS,
    EXPANSION_BASE,
    EXPANSION_PER_BYTE,
    MAX_NESTING,
    SCALARS,
    MetadataLimit,
    TrxpError,
    Work,
)
from .shown import item_where, show


class Shape:
    """Measures item metadata, each container once (by id): nesting depth and the bytes it
    takes written out in full, as the store packs each experience (shared references
    expanded). Walking the data as a tree would cost exponential time for memo references
    shared at every level; here the steps are the references present, which the pickle
    spent at least a byte on each."""

    def __init__(
        self,
        work: Work,
        max_size: int,
        *,
        check_keys: bool,
        containers_of: Collection[str] | None = None,
        limit: MetadataLimit | None = None,
    ) -> None:
        self.work = work
        self.max_size = max_size
        self.limit = limit  # of each item's own size, beside max_size's of them all
        self.check_keys = check_keys  # not needed after the pickle scan, which refused other keys
        # Only the non-empty containers among these fields are measured: for the caller's own
        # experiences, whose other fields check_meta checks part by part.
        self.containers_of = containers_of
        self.size = 0  # of every item measured so far
        # Whether a container may be referenced more than once, so that each is measured once by
        # its id; False (the scan of the pickle found no reference to one made again,
        # parse._load_items) measures each where it is met, its id neither kept nor looked up.
        self.shared = True
        self.known: dict[int, tuple[int, int]] = {}  # id -> (height, size), or _OPEN while being measured
        self.empties: set[int] = set()  # ids of the empty containers met
        self.names: dict[str, int] = {}  # the size of each field name met
        # The last item's field names (str) in its order, and their sizes: the next item's fields,
        # mostly the same str objects in the same order (a pickle's memo), are told by identity.
        self.fields: list[str] = []
        self.field_sizes: list[int] = []

    def forget(self) -> None:
        """Measure what comes next afresh, as one experience alone, its empty containers too: a
        container of an experience let go may stand again at the same address in the next (or a
        caller may change one between two), and must not be taken for the one measured."""
        self.known.clear()
        self.empties.clear()

    def item(self, index: int, uid: str, item: dict[Any, Any]) -> None:
        """Measure every field of an item, counting it towards the payload's expansion bound."""
        if self.containers_of is not None:
            item = {
                name: value for name in self.containers_of if isinstance(value := item.get(name), CONTAINERS) and value
            }
        total, max_size, names = self.size, self.max_size, self.names
        fields, field_sizes = self.fields, self.field_sizes
        at = -1
        for name, value in item.items():
            at += 1
            try:  # the commonest fields inline: None, numbers, plain text, empty and other containers
                if value is None or type(value) is float:
                    size = 9
                elif type(value) is int:
                    size = 6 + value.bit_length() // 8
                elif type(value) is str and value.isascii():
                    size = 5 + len(value)
                elif (type(value) is dict or type(value) is list or type(value) is tuple) and not value:
                    size = _EMPTY[1]
                    self._count_empty(value)
                elif isinstance(value, CONTAINERS):
                    size = self._container(value, 0)[1]
                else:
                    size = _scalar_size(value)
                if at < len(fields) and fields[at] is name:
                    total += size + field_sizes[at]
                elif type(name) is str:  # a field's name, the same str in every item: measured once
                    name_size = names.get(name)
                    if name_size is None:
                        name_size = names[name] = _scalar_size(name)
                    total += size + name_size
                    if at < len(fields):
                        fields[at], field_sizes[at] = name, name_size
                    else:
                        fields.append(name)
                        field_sizes.append(name_size)
                else:
                    total += size + _scalar_size(name)
            except TrxpError as exc:
                raise TrxpError(f"{item_where(index, uid)}: field {show(name)}: {exc}") from None
            if total > max_size:
                raise TrxpError(
                    f"{item_where(index, uid)}: field {show(name)}: metadata expands to more than {max_size} bytes "
                    f"when shared references are written out ({EXPANSION_PER_BYTE} per payload byte + {EXPANSION_BASE})"
                )
        limit = self.limit
        if limit is not None and total - self.size > limit.size:
            raise TrxpError(
                f"{item_where(index, uid)}: its metadata takes {total - self.size} bytes written out, more than "
                f"{limit.name}"
            )
        self.size = total

    def _container(self, value: dict[Any, Any] | list[Any] | tuple[Any, ...], depth: int) -> tuple[int, int]:
        if not value:
            if depth > MAX_NESTING:
                raise TrxpError(f"nested deeper than {MAX_NESTING} levels (or cyclic)")
            self._count_empty(value)
            return _EMPTY
        shared = self.shared
        key = id(value) if shared else 0
        known = self.known.get(key) if shared else None
        if known is None:
            if depth > MAX_NESTING:
                raise TrxpError(f"nested deeper than {MAX_NESTING} levels (or cyclic)")
            work = self.work
            work.used += 1 + len(value)
            if work.used > work.limit:
                work.charge(0)
            size = _EMPTY[1]
            flat = -1
            if isinstance(value, dict):
                if self.check_keys and not all(isinstance(k, (str, bytes)) for k in value):
                    raise TrxpError("dict keys must be str or bytes")
                flat = self._flat(value)
            known = (1, size + flat) if flat >= 0 else self._walked(value, key, size, depth)
            if shared:
                self.known[key] = known
        if depth + known[0] > MAX_NESTING:
            raise TrxpError(f"nested deeper than {MAX_NESTING} levels (or cyclic)")
        return known

    def _walked(
        self, value: dict[Any, Any] | list[Any] | tuple[Any, ...], key: int, size: int, depth: int
    ) -> tuple[int, int]:
        """The height and size of a container not measured by _flat, from `size`: a dict's names
        first, then its values, each container inside measured (`key`: its id, marked open first)."""
        shared = self.shared
        children: Iterable[Any] = value
        if isinstance(value, dict):
            names = self.names
            for name in value:
                name_size = names.get(name) if type(name) is str else None
                if name_size is None:
                    name_size = _scalar_size(name)
                    if type(name) is str:
                        names[name] = name_size
                size += name_size
            children = value.values()
        height, opened = 1, False  # marked open before the first container inside is measured
        for child in children:
            if type(child) is str:  # the common cases inline
                size += 5 + (len(child) if child.isascii() else 4 * len(child))
            elif type(child) is int:
                size += 6 + child.bit_length() // 8
            elif type(child) is float or type(child) is bool or child is None:
                size += 9
            elif isinstance(child, CONTAINERS):
                if shared and not opened:
                    self.known[key], opened = _OPEN, True
                child_height, child_size = self._container(child, depth + 1)
                height = max(height, child_height + 1)
                size += child_size
                if size > self.max_size:
                    break  # refused by the caller; no need to add up the rest
            else:
                size += _scalar_size(child)
        return height, size

    def _flat(self, value: dict[Any, Any]) -> int:
        """The size of a dict's names and values where each value is a str, int, float, bool or None
        (an eid, most of an item's info and metrics), read in one pass over its entries rather than
        its names then its values; -1 for any other, which _container measures in those two passes
        (in their order: the first name or value refused, the sizes at which it stops, as before)."""
        names = self.names
        size = 0
        for name, child in value.items():
            name_size = names.get(name) if type(name) is str else None
            if name_size is None:
                name_size = _scalar_size(name)
                if type(name) is str:
                    names[name] = name_size
            if type(child) is str:
                size += name_size + 5 + (len(child) if child.isascii() else 4 * len(child))
            elif type(child) is int:
                size += name_size + 6 + child.bit_length() // 8
            elif type(child) is float or type(child) is bool or child is None:
                size += name_size + 9
            else:
                return -1
        return size

    def _count_empty(self, value: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> None:
        """Count the step of the empty container `value` at its first reference only (told by its
        id where it may be referenced again): it holds nothing to measure, so it is kept apart from
        `known`, which would make a tuple of it."""
        if self.shared:
            empties = self.empties
            count = len(empties)
            empties.add(id(value))
            if len(empties) == count:
                return
        work = self.work
        work.used += 1
        if work.used > work.limit:
            work.charge(0)


# What a container being measured counts as when met again: a cycle, refused as too deep.
_OPEN: Final = (MAX_NESTING + 1, 0)
# An empty container: no height, and EMPTY_LIST (or dict), MARK, APPENDS (or SETITEMS).
_EMPTY: Final = (0, 3)


def _scalar_size(value: Any) -> int:
    """Bytes a scalar takes in a pickle without memo (str: at most 4 bytes a character)."""
    if isinstance(value, str):
        return 5 + (len(value) if value.isascii() else 4 * len(value))
    if isinstance(value, bytes):
        return 5 + len(value)
    if isinstance(value, int):
        return 6 + value.bit_length() // 8
    if isinstance(value, SCALARS):
        return 9
    raise TrxpError(f"{type(value).__name__} is not plain data")
