"""The metadata pickle, read safely: an opcode scan that admits plain data only and bounds
memo references and the unpickler's own work, and an unpickler that refuses every global.
"""

from __future__ import annotations

import pickle
import pickletools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


from .checks import _clip
from .common import (
    _APPEND,
    _APPENDS,
    _DICT,
    _DUP,
    _FROM_MARK,
    _GET,
    _KEY,
    _MARK,
    _MEMOIZE,
    _NOOP,
    _PLAIN_EFFECTS,
    _POP,
    _POP_MARK,
    _PUT,
    _SETITEM,
    _SETITEMS,
    _TUPLE1,
    _TUPLE2,
    _TUPLE3,
    _VALUE,
    TrxpError,
    Work,
)


class PlainUnpickler(pickle.Unpickler):
    """Reads plain data only: every global is refused, never looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise TrxpError(f"metadata: pickle references the global {_clip(module)}.{_clip(name)}; refused")

    def persistent_load(self, pid: Any) -> Any:
        raise TrxpError("metadata: pickle uses persistent ids; refused")


# Plain-data opcodes by byte: (name, argument size, stack effect), the size as pickletools
# describes it (>= 0: fixed; negative: up to a newline, or length-prefixed by 1, 4 or 8 bytes).
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_PLAIN_TABLE = {
    op.code.encode("latin-1")[0]: (op.name, op.arg.n if op.arg else 0, _PLAIN_EFFECTS[op.name])
    for op in pickletools.opcodes
    if op.name in _PLAIN_EFFECTS
}
_LENGTH_PREFIX = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def scan_pickle(data: memoryview, work: Work) -> None:
    """Refuse any opcode that is not plain data, memo indices beyond reason, and dict keys
    other than str or bytes.

    The scan walks the opcodes without executing anything, before the unpickler sees
    them: it stops a tiny pickle from making the unpickler allocate a huge memo, and
    everything but plain data from being built at all. It follows the unpickler's stack
    (whether each entry is a str or bytes, nothing more) so that every dict key is known
    to hash in time linear in its length: ints hash predictably (so keys can be made to
    collide, a quadratic dict) and tuples of shared tuples hash in exponential time.
    """
    raw = bytes(data)
    pos, size, ops = 0, len(raw), 0
    stack: list[bool] = []  # per entry: may it be a dict key (str or bytes)?
    marks: list[int] = []  # stack heights at each MARK
    fence = 0  # the height of the last mark: entries below it belong to an outer MARK
    memo: dict[int, bool] = {}
    push = stack.append
    memoize, get, key, value, put = _MEMOIZE, _GET, _KEY, _VALUE, _PUT  # locals: the loop's hot path
    while pos < size:
        code = raw[pos]
        spec = _PLAIN_TABLE.get(code)
        if spec is None:
            name = _OPCODE_NAMES.get(code, f"0x{code:02x}")
            raise TrxpError(f"metadata: pickle opcode {name} is not plain data (globals and objects are refused)")
        name, arg_size, effect = spec
        ops += 1
        start = pos = pos + 1
        if arg_size >= 0:
            pos += arg_size
        elif arg_size == pickletools.UP_TO_NEWLINE:
            newline = raw.find(b"\n", pos)
            if newline < 0:
                raise TrxpError(f"metadata: pickle is truncated in {name}")
            pos = newline + 1
        else:
            width, signed = _LENGTH_PREFIX[arg_size]
            length = int.from_bytes(raw[pos : pos + width], "little", signed=signed)
            if length < 0:
                raise TrxpError(f"metadata: pickle {name} has a negative length")
            start = pos = pos + width
            pos += length
        if pos > size:
            raise TrxpError(f"metadata: pickle is truncated in {name}")
        if effect == memoize:  # the commonest opcodes first
            if len(stack) <= fence:
                raise TrxpError(f"metadata: pickle {name} finds an empty stack")
            memo[len(memo)] = stack[-1]
        elif effect == get:
            memo_index = raw[start] if arg_size == 1 else _memo_index(name, raw[start:pos], ops)
            if memo_index not in memo:
                raise TrxpError(f"metadata: pickle {name} reads memo entry {memo_index}, which was never stored")
            push(memo[memo_index])
        elif effect == key:
            push(True)
        elif effect == value:
            push(False)
        elif effect == put:
            if len(stack) <= fence:
                raise TrxpError(f"metadata: pickle {name} finds an empty stack")
            memo[_memo_index(name, raw[start:pos], ops)] = stack[-1]
        elif effect == _MARK:
            marks.append(len(stack))
            fence = len(stack)
        elif effect in (_FROM_MARK, _DICT, _APPENDS, _SETITEMS, _POP_MARK):
            if not marks:
                raise TrxpError(f"metadata: pickle {name} has no MARK")
            mark = marks.pop()
            fence = marks[-1] if marks else 0
            if effect in (_DICT, _SETITEMS) and not all(stack[mark::2]):
                raise TrxpError("metadata: dict keys must be str or bytes")
            del stack[mark:]
            if effect in (_FROM_MARK, _DICT):
                push(False)
        elif effect in (_TUPLE1, _TUPLE2, _TUPLE3, _APPEND, _SETITEM):
            count = {_TUPLE1: 1, _TUPLE2: 2, _TUPLE3: 3, _APPEND: 1, _SETITEM: 2}[effect]
            if len(stack) - count < fence:
                raise TrxpError(f"metadata: pickle {name} finds too few entries on the stack")
            if effect == _SETITEM and not stack[-2]:
                raise TrxpError("metadata: dict keys must be str or bytes")
            del stack[len(stack) - count :]
            if effect not in (_APPEND, _SETITEM):
                push(False)
        elif effect == _NOOP:
            pass
        elif effect == _POP and marks and marks[-1] == len(stack):
            marks.pop()
            fence = marks[-1] if marks else 0
        elif len(stack) <= fence:
            raise TrxpError(f"metadata: pickle {name} finds an empty stack")
        elif effect == _DUP:
            push(stack[-1])
        elif effect == _POP:
            stack.pop()
        else:  # STOP
            if pos != size:
                raise TrxpError(f"metadata: {size - pos} bytes after the end of the pickle")
            work.charge(ops)
            return
    raise TrxpError("metadata: pickle is truncated (no STOP)")


def _memo_index(name: str, arg: bytes, ops: int) -> int:
    """The memo index a PUT or GET names, refused beyond the opcodes read so far."""
    if name in ("PUT", "GET"):  # protocol 0: a decimal index and a newline
        digits = arg[:-1]
        if not digits.isdigit() or len(digits) > 20:
            raise TrxpError(f"metadata: pickle {name} has a malformed index")
        index = int(digits)
    else:
        index = int.from_bytes(arg, "little")
    if index > ops:
        raise TrxpError(f"metadata: pickle memo index {index} out of range")
    return index
