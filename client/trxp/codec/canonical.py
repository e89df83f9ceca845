"""An item's canonical metadata pickle written directly: the opcodes CPython's C pickler writes for
the metadata with every dict's keys sorted (protocol 3, fast mode: no memo), without the sorted copy
of the metadata the pickler needs nor the pickler's own calls. A push packs every experience's
metadata so (build.pack_item), which made the copy and the pickle about a sixth of what the server
spends on a pushed 8 KB experience.

It writes the plain data an experience's metadata is made of: dicts with str keys and lists of up
to BATCH entries, str of less than LARGE bytes, bool, None, float, and int within int32. For
anything else (a tuple, bytes, a larger int, container or str) it answers None, and the caller
pickles the metadata as before: the bytes are the same either way (tests/test_trxp_canonical.py
holds them equal over generated data), so a stored experience's digest does not depend on which
path packed it.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

# The C pickler's batch of SETITEMS and APPENDS: a container of more entries is written in batches,
# which this writer leaves to the pickler.
BATCH = 1000
# A str of this many bytes or more the pickler hands to its writer without copying it (build.fragment's
# runs); such a value is left to it too.
LARGE = 1 << 16
_INT32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_DOUBLE = struct.Struct(">d")
# The opcodes of each small int; and, of each sequence of dict keys met (an experience's fields, its
# eid's parts: the same in every item a client writes), the keys sorted with their opcodes.
_SMALL = [b"K" + bytes([value]) for value in range(256)]  # BININT1
_ORDERS: dict[tuple[Any, ...], list[tuple[int, bytes]]] = {}
_ORDERS_KEPT = 1024
_NAME = operator.itemgetter(1)
# Of each dict size, the keys last met and their order: the dicts of a payload's items repeat them.
_RECENT: dict[int, tuple[tuple[Any, ...], list[tuple[int, bytes]]]] = {}


def opcodes(meta: dict[str, Any]) -> bytes | None:
    """`meta`'s canonical pickle's opcodes, without PROTO and STOP; None where it holds anything
    this writer leaves to the pickler."""
    out: list[bytes] = []
    return b"".join(out) if _dict(meta, out) else None


def _dict(value: dict[Any, Any], out: list[bytes]) -> bool:
    size = len(value)
    if not size:
        out.append(b"}")  # EMPTY_DICT
        return True
    if size >= BATCH:
        return False
    keys = _same_keys(value, size)
    if keys is None:
        names = tuple(value)
        keys = _ORDERS.get(names)
        if keys is None:
            keys = _ordered(names)
            if keys is None:
                return False
        _RECENT[size] = (names, keys)
    out.append(b"}(" if size > 1 else b"}")  # EMPTY_DICT, MARK
    values = list(value.values())  # read by position: a list's index costs less than a key's lookup
    for at, opcode in keys:
        out.append(opcode)
        if not _value(values[at], out):
            return False
    out.append(b"u" if size > 1 else b"s")  # SETITEMS, SETITEM
    return True


def _same_keys(value: dict[Any, Any], size: int) -> list[tuple[int, bytes]] | None:
    """The order of the keys last met in a dict of `size` keys where `value` holds the very same key
    objects in the same order (an unpickled payload's items share their field names' objects, through
    its memo), found without the tuple and its hash that _ORDERS' lookup needs; None otherwise."""
    recent = _RECENT.get(size)
    if recent is None:
        return None
    names, keys = recent
    for at, name in enumerate(value):
        if name is not names[at]:
            return None
    return keys


def _ordered(names: tuple[Any, ...]) -> list[tuple[int, bytes]] | None:
    """A dict's keys (`names`, in its order) sorted, each as its position in `names` with its opcode,
    remembered; None where one is not a str this writer writes."""
    if not all(type(name) is str for name in names):
        return None
    keys = []
    for at, name in sorted(enumerate(names), key=_NAME):
        opcode = _str(name)
        if opcode is None:
            return None
        keys.append((at, opcode))
    if len(_ORDERS) >= _ORDERS_KEPT:
        _ORDERS.clear()
    _ORDERS[names] = keys
    return keys


def _list(value: list[Any], out: list[bytes]) -> bool:
    size = len(value)
    if not size:
        out.append(b"]")  # EMPTY_LIST
        return True
    if size > BATCH:
        return False
    out.append(b"](" if size > 1 else b"]")  # EMPTY_LIST, MARK
    for item in value:
        if not _value(item, out):
            return False
    out.append(b"e" if size > 1 else b"a")  # APPENDS, APPEND
    return True


def _str(value: str) -> bytes | None:
    """A str's opcode (BINUNICODE), its UTF-8 as the pickler encodes it (lone surrogates kept)."""
    data = value.encode() if value.isascii() else value.encode("utf-8", "surrogatepass")
    if len(data) >= LARGE:
        return None
    return b"X" + _U32.pack(len(data)) + data


def _value(value: Any, out: list[bytes]) -> bool:
    kind = type(value)
    if kind is str:
        opcode = _str(value)
        if opcode is None:
            return False
        out.append(opcode)
    elif value is None:
        out.append(b"N")
    elif kind is float:
        out.append(b"G" + _DOUBLE.pack(value))  # BINFLOAT
    elif kind is bool:
        out.append(b"\x88" if value else b"\x89")  # NEWTRUE, NEWFALSE
    elif kind is int:
        if 0 <= value <= 0xFF:
            out.append(_SMALL[value])
        elif 0 <= value <= 0xFFFF:
            out.append(b"M" + _U16.pack(value))  # BININT2
        elif -(1 << 31) <= value < (1 << 31):
            out.append(b"J" + _INT32.pack(value))  # BININT
        else:
            return False
    elif kind is dict:
        return _dict(value, out)
    elif kind is list:
        return _list(value, out)
    else:
        return False
    return True
