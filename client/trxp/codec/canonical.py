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
from typing import Any, Final, final

# The C pickler's batch of SETITEMS and APPENDS: a container of more entries is written in batches,
# which this writer leaves to the pickler.
BATCH: Final = 1000
# A str of this many bytes or more the pickler hands to its writer without copying it (build.fragment's
# runs); such a value is left to it too.
LARGE: Final = 1 << 16
# Each bound once: a call of a Struct's method looks the method up at every call.
_BININT: Final = struct.Struct("<ci").pack
_BININT2: Final = struct.Struct("<cH").pack
_BINUNICODE: Final = struct.Struct("<cI").pack
_BINFLOAT: Final = struct.Struct(">cd").pack
# The opcodes of each small int; and, of each sequence of dict keys met (an experience's fields, its
# eid's parts: the same in every item a client writes), the keys sorted with their opcodes.
_SMALL: Final = [b"K" + bytes([value]) for value in range(256)]  # BININT1
_ORDERS: Final[dict[tuple[Any, ...], list[tuple[int, bytes]]]] = {}
_ORDERS_KEPT: Final = 1024
_NAME: Final = operator.itemgetter(1)
# The opcodes of short str values met (an eid's suffix and task, a message's role): most repeat.
_TEXTS: Final[dict[str, bytes]] = {}
_TEXTS_KEPT: Final = 4096
_TEXT_KEPT_LEN: Final = 64

# What a value of a dict is, as a plan (_Plan) keeps it: a value written the same whatever it
# holds (None, an empty list or dict), or of a kind whose opcodes are written from its value.
_NONE: Final = 0
_EMPTY_LIST: Final = 1
_EMPTY_DICT: Final = 2
_STR: Final = 3
_INT: Final = 4
_FLOAT: Final = 5
_BOOL: Final = 6
_DICT: Final = 7
_LIST: Final = 8
_FIXED: Final = [b"N", b"]", b"}"]  # the opcodes of the values written the same, by kind


@final
class _Plan:
    """How a dict of these keys (in this order) whose values are of these kinds is written: the
    opcodes of its keys and of its values written the same joined into the runs between the values
    written from their content. A payload's items repeat their fields and their values' kinds, so
    an item is mostly written as the item before was, a few values formatted."""

    def __init__(self, names: list[Any], fixed: list[int], fixed_kinds: list[int]) -> None:
        self.names = names  # the keys, in the dict's order
        self.fixed = fixed  # the positions of the values written the same, and their kinds
        self.fixed_kinds = fixed_kinds
        self.at: list[int] = []  # the positions of the values written from their content, sorted by key
        self.kinds: list[int] = []
        self.runs: list[bytes] = []  # the opcodes written before each of them
        self.tail = b""  # and after the last


# Of each dict size, the plan of the dict last written: the dicts of a payload's items repeat them.
_PLANS: Final[list[_Plan | None]] = [None] * BATCH


def opcodes(meta: dict[str, Any]) -> bytes | None:
    """`meta`'s canonical pickle's opcodes, without PROTO and STOP; None where it holds anything
    this writer leaves to the pickler."""
    out: list[bytes] = []
    return b"".join(out) if _dict(meta, out) else None


def write(meta: dict[str, Any], out: list[bytes]) -> bool:
    """Append `meta`'s canonical pickle's opcodes (without PROTO and STOP) to `out`; False, some
    perhaps appended, where it holds anything this writer leaves to the pickler."""
    return _dict(meta, out)


def _dict(value: dict[Any, Any], out: list[bytes]) -> bool:
    size = len(value)
    if not size:
        out.append(b"}")  # EMPTY_DICT
        return True
    if size >= BATCH:
        return False
    names = list(value.keys())  # PyDict_Keys: list(value) iterates
    values = list(value.values())  # read by position: a list's index costs less than a key's lookup
    plan = _PLANS[size]
    if plan is not None and names == plan.names:
        plan.names = names  # the next item's keys are mostly these very objects: compared by identity
        done = len(out)
        written = _planned(plan, values, out)
        if written >= 0:
            return written == 1
        del out[done:]  # a value of another kind than the plan's
    keys = _ORDERS.get(tuple(names))
    if keys is None:
        keys = _ordered(names)
        if keys is None:
            return False
    plan = _plan(names, keys, values)
    if plan is None:
        return False
    _PLANS[size] = plan
    return _planned(plan, values, out) == 1


def _planned(plan: _Plan, values: list[Any], out: list[bytes]) -> int:
    """Write the dict of `values` by `plan`: 1 written, 0 where it holds what this writer leaves to
    the pickler, -1 where a value is not of the plan's kind."""
    kinds = plan.fixed_kinds
    for slot, at in enumerate(plan.fixed):
        value = values[at]
        kind = kinds[slot]
        if kind == _NONE:
            if value is not None:
                return -1
        elif type(value) is not (list if kind == _EMPTY_LIST else dict) or value:
            return -1
    runs = plan.runs
    for slot, kind in enumerate(plan.kinds):
        value = values[plan.at[slot]]
        out.append(runs[slot])
        if kind == _STR:
            if type(value) is not str:
                return -1
            opcode = _text(value)
            if opcode is None:
                return 0
            out.append(opcode)
        elif kind == _INT:
            if type(value) is not int:
                return -1
            if not _int(value, out):
                return 0
        elif kind == _FLOAT:
            if type(value) is not float:
                return -1
            out.append(_BINFLOAT(b"G", value))
        elif kind == _BOOL:
            if type(value) is not bool:
                return -1
            out.append(b"\x88" if value else b"\x89")  # NEWTRUE, NEWFALSE
        elif kind == _DICT:
            if type(value) is not dict or not value:
                return -1
            if not _dict(value, out):
                return 0
        elif type(value) is not list or not value:
            return -1
        elif not _list(value, out):
            return 0
    out.append(plan.tail)
    return 1


def _plan(names: list[Any], keys: list[tuple[int, bytes]], values: list[Any]) -> _Plan | None:
    """The plan of a dict of `names` (sorted as `keys`) and `values`; None where a value is of a
    kind this writer leaves to the pickler."""
    plan = _Plan(names, [], [])
    run = b"}(" if len(names) > 1 else b"}"  # EMPTY_DICT, MARK
    for at, opcode in keys:
        run += opcode
        kind = _kind(values[at])
        if kind < 0:
            return None
        if kind <= _EMPTY_DICT:
            plan.fixed.append(at)
            plan.fixed_kinds.append(kind)
            run += _FIXED[kind]
        else:
            plan.at.append(at)
            plan.kinds.append(kind)
            plan.runs.append(run)
            run = b""
    plan.tail = run + (b"u" if len(names) > 1 else b"s")  # SETITEMS, SETITEM
    return plan


def _kind(value: Any) -> int:
    """A value's kind in a plan; -1 where this writer leaves it to the pickler."""
    kind = type(value)
    if value is None:
        return _NONE
    if kind is str:
        return _STR
    if kind is int:
        return _INT
    if kind is float:
        return _FLOAT
    if kind is bool:
        return _BOOL
    if kind is dict:
        return _DICT if value else _EMPTY_DICT
    if kind is list:
        return _LIST if value else _EMPTY_LIST
    return -1


def _ordered(names: list[Any]) -> list[tuple[int, bytes]] | None:
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
    _ORDERS[tuple(names)] = keys
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
    return _BINUNICODE(b"X", len(data)) + data


def _text(value: str) -> bytes | None:
    """_str, of a short value remembered."""
    opcode = _TEXTS.get(value)
    if opcode is None:
        opcode = _str(value)
        if opcode is not None and len(value) <= _TEXT_KEPT_LEN:
            if len(_TEXTS) >= _TEXTS_KEPT:
                _TEXTS.clear()
            _TEXTS[value] = opcode
    return opcode


def _int(value: int, out: list[bytes]) -> bool:
    if 0 <= value <= 0xFF:
        out.append(_SMALL[value])
    elif 0 <= value <= 0xFFFF:
        out.append(_BININT2(b"M", value))
    elif -(1 << 31) <= value < (1 << 31):
        out.append(_BININT(b"J", value))
    else:
        return False
    return True


def _value(value: Any, out: list[bytes]) -> bool:
    kind = type(value)
    if kind is str:
        opcode = _text(value)
        if opcode is None:
            return False
        out.append(opcode)
    elif value is None:
        out.append(b"N")
    elif kind is float:
        out.append(_BINFLOAT(b"G", value))
    elif kind is bool:
        out.append(b"\x88" if value else b"\x89")  # NEWTRUE, NEWFALSE
    elif kind is int:
        return _int(value, out)
    elif kind is dict:
        return _dict(value, out)
    elif kind is list:
        return _list(value, out)
    else:
        return False
    return True
