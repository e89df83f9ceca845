"""The metadata pickle, read safely: an opcode scan that admits plain data only and bounds
memo references and the unpickler's own work (the unpickler that refuses every global is in
unpickler.py).
"""

from __future__ import annotations

import pickletools
import re
from dataclasses import dataclass
from typing import Final

from .common import TrxpError, Work

# Pickle opcodes that build plain data only, with their effect on the unpickler's stack (each
# a Final int, which compiled code compares without looking it up in the module's dict).
# Everything else (globals, reduce, build, persistent ids, sets, out-of-band buffers) is
# refused before unpickling.
_NOOP: Final = 0
_KEY: Final = 1
_VALUE: Final = 2
_MARK: Final = 3
_POP: Final = 4
_POP_MARK: Final = 5
_DUP: Final = 6
_FROM_MARK: Final = 7
_DICT: Final = 8
_TUPLE1: Final = 9
_TUPLE2: Final = 10
_TUPLE3: Final = 11
_APPEND: Final = 12
_APPENDS: Final = 13
_SETITEM: Final = 14
_SETITEMS: Final = 15
_MEMOIZE: Final = 16
_PUT: Final = 17
_GET: Final = 18
_STOP: Final = 19
_PLAIN_EFFECTS = {
    "PROTO": _NOOP, "FRAME": _NOOP, "STOP": _STOP, "MARK": _MARK, "POP": _POP, "POP_MARK": _POP_MARK, "DUP": _DUP,
    "EMPTY_DICT": _VALUE, "DICT": _DICT, "SETITEM": _SETITEM, "SETITEMS": _SETITEMS,
    "EMPTY_LIST": _VALUE, "LIST": _FROM_MARK, "APPEND": _APPEND, "APPENDS": _APPENDS,
    "EMPTY_TUPLE": _VALUE, "TUPLE": _FROM_MARK, "TUPLE1": _TUPLE1, "TUPLE2": _TUPLE2, "TUPLE3": _TUPLE3,
    "NONE": _VALUE, "NEWTRUE": _VALUE, "NEWFALSE": _VALUE,
    "INT": _VALUE, "BININT": _VALUE, "BININT1": _VALUE, "BININT2": _VALUE,
    "LONG": _VALUE, "LONG1": _VALUE, "LONG4": _VALUE, "FLOAT": _VALUE, "BINFLOAT": _VALUE,
    "UNICODE": _KEY, "SHORT_BINUNICODE": _KEY, "BINUNICODE": _KEY, "BINUNICODE8": _KEY,
    "SHORT_BINBYTES": _KEY, "BINBYTES": _KEY, "BINBYTES8": _KEY,
    "MEMOIZE": _MEMOIZE, "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT,
    "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET,
}  # fmt: skip


# Plain-data opcodes by byte: (name, argument size, stack effect), the size as pickletools
# describes it (>= 0: fixed; negative: up to a newline, or length-prefixed by 1, 4 or 8 bytes);
# None for every other byte.
_OPCODE_NAMES: Final = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_PLAIN_TABLE: Final[list[tuple[str, int, int] | None]] = [None] * 256
for _op in pickletools.opcodes:
    if _op.name in _PLAIN_EFFECTS:
        _PLAIN_TABLE[_op.code.encode("latin-1")[0]] = (_op.name, _op.arg.n if _op.arg else 0, _PLAIN_EFFECTS[_op.name])
_LENGTH_PREFIX: Final = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}
_TAKES: Final = {_TUPLE1: 1, _TUPLE2: 2, _TUPLE3: 3, _APPEND: 1, _SETITEM: 2}  # entries an opcode takes off the stack
_CLOSES: Final = (_FROM_MARK, _DICT, _APPENDS, _SETITEMS, _POP_MARK)  # opcodes that take the entries above a MARK
# Nearly every opcode of Trinity-RFT's metadata takes one of the scan's short paths, by kind:
# BINGET (a memoized key, mostly), MEMOIZE, a value of a fixed size (NONE, BININT1, BINFLOAT,
# an empty container), a short str or bytes, MARK, and what closes a MARK. _KIND[code] is 0
# for every other byte (the general path); _STEP[code] is the size of a fixed-size opcode.
_K_GET1: Final = 1  # each a Final int, which compiled code compares without looking it up
_K_MEMOIZE: Final = 2
_K_VALUE: Final = 3
_K_SHORT_KEY: Final = 4
_K_KEY: Final = 5
_K_MARK: Final = 6
_K_CLOSE: Final = 7
_KIND: Final = [0] * 256
_STEP: Final = [0] * 256
_EFFECT: Final = [-1] * 256  # a plain opcode's stack effect; -1 for every other byte
for _code, _spec in enumerate(_PLAIN_TABLE):
    if _spec is not None:
        _, _size, _effect = _spec
        _EFFECT[_code] = _effect
        _STEP[_code] = 1 + max(_size, 0)
        _KIND[_code] = (
            _K_GET1 if _effect == _GET and _size == 1
            else _K_MEMOIZE if _effect == _MEMOIZE
            else _K_VALUE if _effect == _VALUE and _size >= 0
            else _K_SHORT_KEY if _effect == _KEY and _size == pickletools.TAKEN_FROM_ARGUMENT1
            else _K_KEY if _effect == _KEY and _size == pickletools.TAKEN_FROM_ARGUMENT4U
            else _K_MARK if _effect == _MARK
            else _K_CLOSE if _effect in _CLOSES
            else 0
        )  # fmt: skip


# _KIND once the memo's indices are not 0, 1, 2... (a PUT skipped one): a memo read or MEMOIZE
# takes the general path, which keeps such a memo in a dict.
_SPARSE_KIND: Final = [0 if kind in (_K_GET1, _K_MEMOIZE) else kind for kind in _KIND]
_PUTS: Final = frozenset(code for code, spec in enumerate(_PLAIN_TABLE) if spec is not None and spec[2] == _PUT)
# Replaying segments (see _Segment) pays when the same shapes come back many times: a batch of
# experiences. The limits bound what recording them costs in a pickle that repeats nothing.
_SEGMENT_BYTES = 1024  # the longest segment recorded
_SEGMENT_REPEATS = 16  # recorded only if the pickle has room left for this many more like it
_SEGMENTS_RECORDED = 8  # per pickle
_SEGMENTS_COMPILED = 4  # per pickle: compiling a pattern costs as much as scanning some ten times its bytes
_SEGMENTS_KEPT = 4  # the most recent, tried at each MARK
# Segments looked at to record them, nested ones included, take at most this share of the
# pickle's bytes (in bytes looked at), and failed matches at most its size.
_RECORDING_SHARE = 2
_RECORDING_MIN = 4096  # the smallest pickle that records segments: a smaller one has little to repeat
_ESCAPED: Final = [re.escape(bytes([code])) for code in range(256)]  # each byte as a pattern matches it


# Opcodes a segment may hold besides BINGET: their effect on the stack and the memo does not
# depend on their argument, only on the stack entries inside the segment (PUT, POP and DUP,
# which may reach below it or rewrite the memo, are left out).
_REPLAYABLE: Final = frozenset({_KEY, _VALUE, _MEMOIZE, _MARK, _NOOP, *_CLOSES, *_TAKES})


@dataclass
class _Segment:
    """The opcodes from a MARK to the one that closes it, as the scan met them: a pattern of
    the same opcodes (each memo index read the same, each str, bytes or long int the same
    length, any argument of a fixed size) and what they did. Met again while the memo only
    grows (no PUT), the same opcodes do the same: every index they read names the same entry,
    and every check inside them sees the same stack entries, so the scan replays their effect."""

    source: bytes  # the pattern, compiled when the bytes at a MARK start with its prefix
    prefix: bytes  # the bytes before its first argument of any value
    length: int  # bytes
    ops: int
    memoized: tuple[bool, ...]  # the memo entries they add, in order
    leaves_entry: bool  # closed by LIST, TUPLE or DICT: one entry (not a key) stays on the stack
    pattern: re.Pattern[bytes] | None = None

    @classmethod
    def record(cls, raw: bytes, start: int, end: int, ops: int, memo: list[bool], before: int) -> _Segment | None:
        """The segment raw[start:end], just scanned, which found `before` memo entries and left
        the rest of `memo`; None if it holds other opcodes or reads an entry made inside it
        (whose index differs in each repeat)."""
        parts: list[bytes] = []
        pos, literal = start, None
        while pos < end:
            code = raw[pos]
            spec = _PLAIN_TABLE[code]
            if spec is None:
                return None
            _, arg_size, effect = spec
            if _KIND[code] == _K_GET1 and raw[pos + 1] < before:
                head, size = 2, 0
            elif effect in _REPLAYABLE and arg_size >= 0:
                head, size = 1, arg_size
            elif effect in (_KEY, _VALUE) and arg_size in _LENGTH_PREFIX:
                width, signed = _LENGTH_PREFIX[arg_size]
                head, size = 1 + width, int.from_bytes(raw[pos + 1 : pos + 1 + width], "little", signed=signed)
            else:
                return None
            for at in range(pos, pos + head):  # a loop, not a generator: compiled, that is an object an opcode
                parts.append(_ESCAPED[raw[at]])
            if size:
                parts.append(b".{%d}" % size)
                literal = pos + head if literal is None else literal
            pos += head + size
        memoized = tuple(memo[before:])
        leaves_entry = _EFFECT[raw[end - 1]] in (_FROM_MARK, _DICT)
        prefix = raw[start : end if literal is None else literal]
        return cls(b"".join(parts), prefix, end - start, ops, memoized, leaves_entry)


def scan_pickle(data: memoryview, work: Work) -> bool:
    """Refuse any opcode that is not plain data, memo indices beyond reason, and dict keys
    other than str or bytes. Whether a value that may be a container is read from the memo or
    duplicated, so that it may be referenced more than once: without such a read every
    container the unpickler makes of the pickle is referenced once (Shape.shared).

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
    memo: list[bool] = []  # per memo entry, 0, 1, 2...: may it be a dict key?
    sparse: dict[int, bool] = {}  # the memo instead, by index, once a PUT skipped an index (never empty then)
    starts: list[tuple[int, int, int]] = []  # per MARK: its position, the ops and memo entries before it
    segments: list[_Segment] = []  # the most recent first; none once a PUT has written anywhere in the memo
    to_record = _SEGMENTS_RECORDED if size >= _RECORDING_MIN else 0
    to_compile, looked_at, missed = _SEGMENTS_COMPILED, 0, 0
    push, kind_of, step = stack.append, _KIND, _STEP  # locals: the loop's hot path
    shared = False  # whether a memo read or DUP pushed an entry that may be a container
    while pos < size:
        code = raw[pos]
        kind = kind_of[code]
        ops += 1
        if kind == _K_GET1:
            pos += 2
            if pos > size:
                raise _truncated(code)
            if raw[pos - 1] >= len(memo):
                raise _never_stored(code, raw[pos - 1])
            flag = memo[raw[pos - 1]]
            if not flag:
                shared = True
            push(flag)
        elif kind == _K_VALUE:
            pos += step[code]
            if pos > size:
                raise _truncated(code)
            push(False)
        elif kind == _K_MEMOIZE:
            pos += 1
            if len(stack) <= fence:
                raise _empty_stack(code)
            memo.append(stack[-1])
        elif kind == _K_SHORT_KEY:
            pos += 2
            if pos <= size:
                pos += raw[pos - 1]
            if pos > size:
                raise _truncated(code)
            push(True)
        elif kind == _K_KEY:  # BINUNICODE, BINBYTES: every str of a pickle without memo
            pos += 5
            if pos <= size:
                pos += int.from_bytes(raw[pos - 4 : pos], "little")
            if pos > size:
                raise _truncated(code)
            push(True)
        elif kind == _K_MARK:
            match = None
            for segment in segments:
                pattern = segment.pattern
                if pattern is None and to_compile and raw.startswith(segment.prefix, pos):
                    to_compile -= 1  # compiled only once met where its bytes start: its pattern starts with them
                    pattern = segment.pattern = re.compile(segment.source, re.DOTALL)
                if pattern is not None:
                    match = pattern.match(raw, pos)
                    if match:
                        break
                missed += segment.length  # what a failed match costs at most: the patterns never backtrack
            if match:
                pos = match.end()
                ops += segment.ops - 1
                memo.extend(segment.memoized)
                if segment.leaves_entry:
                    push(False)
                continue
            if missed > size:  # segments do not repeat here: scan on without them
                to_record = 0
                segments.clear()
            if to_record:
                starts[len(marks) :] = [(pos, ops - 1, len(memo))]
            pos += 1
            fence = len(stack)
            marks.append(fence)
        elif kind == _K_CLOSE:
            pos += 1
            effect = _EFFECT[code]
            if not marks:
                raise TrxpError(f"metadata: pickle {_OPCODE_NAMES[code]} has no MARK")
            mark = marks.pop()
            fence = marks[-1] if marks else 0
            if effect in (_SETITEMS, _DICT) and not all(stack[mark::2]):
                raise TrxpError("metadata: dict keys must be str or bytes")
            del stack[mark:]
            if effect in (_FROM_MARK, _DICT):
                push(False)
            if to_record:
                start, before_ops, before_memo = starts[len(marks)]
                length = pos - start
                if (
                    length <= _SEGMENT_BYTES
                    and size - pos >= _SEGMENT_REPEATS * length
                    and (looked_at + length) * _RECORDING_SHARE <= size
                ):
                    looked_at += length  # recording costs are bounded by the limits, so not counted as work
                    recorded = _Segment.record(raw, start, pos, ops - before_ops, memo, before_memo)
                    if recorded is not None:
                        to_record -= 1
                        segments[:] = [recorded, *segments[: _SEGMENTS_KEPT - 1]]
        else:
            if code in _PUTS:  # memo entries may change from here on: no segment is replayed
                to_record = 0
                segments.clear()
            pos, fence, copied = _general(raw, pos, ops, stack, marks, fence, memo, sparse)
            shared = shared or copied
            if sparse:
                kind_of = _SPARSE_KIND
            if pos > size:  # STOP
                work.charge(ops)
                return shared
    raise TrxpError("metadata: pickle is truncated (no STOP)")


def _general(
    raw: bytes,
    pos: int,
    ops: int,
    stack: list[bool],
    marks: list[int],
    fence: int,
    memo: list[bool],
    sparse: dict[int, bool],
) -> tuple[int, int, bool]:
    """scan_pickle's path for every other opcode: its checks and stack effect; return the
    position after it, the new fence (a position past the end after STOP) and whether it pushed
    again an entry that may be a container (a memo read of one, DUP)."""
    code, size, push = raw[pos], len(raw), stack.append
    spec = _PLAIN_TABLE[code]
    if spec is None:
        name = _OPCODE_NAMES.get(code, f"0x{code:02x}")
        raise TrxpError(f"metadata: pickle opcode {name} is not plain data (globals and objects are refused)")
    name, arg_size, effect = spec
    start = pos = pos + 1
    if arg_size >= 0:
        pos += arg_size
    elif arg_size == pickletools.UP_TO_NEWLINE:
        newline = raw.find(b"\n", pos)
        if newline < 0:
            raise _truncated(code)
        pos = newline + 1
    else:
        width, signed = _LENGTH_PREFIX[arg_size]
        length = int.from_bytes(raw[pos : pos + width], "little", signed=signed)
        if length < 0:
            raise TrxpError(f"metadata: pickle {name} has a negative length")
        start = pos = pos + width
        pos += length
    if pos > size:
        raise _truncated(code)
    if effect == _KEY:
        push(True)
    elif effect == _VALUE:
        push(False)
    elif effect == _GET:  # BINGET (here once the memo is sparse) is not bounded by the ops read, as in the loop
        memo_index = raw[start] if arg_size == 1 else _memo_index(name, raw[start:pos], ops)
        flag = sparse.get(memo_index) if sparse else memo[memo_index] if memo_index < len(memo) else None
        if flag is None:
            raise _never_stored(code, memo_index)
        push(flag)
        return pos, fence, not flag
    elif effect == _PUT:
        if len(stack) <= fence:
            raise _empty_stack(code)
        _put(memo, sparse, _memo_index(name, raw[start:pos], ops), stack[-1])
    elif effect in _TAKES:
        count = _TAKES[effect]
        if len(stack) - count < fence:
            raise TrxpError(f"metadata: pickle {name} finds too few entries on the stack")
        if effect == _SETITEM and not stack[-2]:
            raise TrxpError("metadata: dict keys must be str or bytes")
        del stack[len(stack) - count :]
        if effect not in (_APPEND, _SETITEM):
            push(False)
    elif effect == _NOOP:
        pass
    elif effect == _MEMOIZE:  # the memo is sparse: MEMOIZE writes the index of its count of entries
        if len(stack) <= fence:
            raise _empty_stack(code)
        sparse[len(sparse)] = stack[-1]
    elif effect == _POP and marks and marks[-1] == len(stack):
        marks.pop()
        fence = marks[-1] if marks else 0
    elif len(stack) <= fence:
        raise _empty_stack(code)
    elif effect == _DUP:
        push(stack[-1])
        return pos, fence, True
    elif effect == _POP:
        stack.pop()
    else:  # STOP
        if pos != size:
            raise TrxpError(f"metadata: {size - pos} bytes after the end of the pickle")
        return size + 1, fence, False
    return pos, fence, False


def _put(memo: list[bool], sparse: dict[int, bool], index: int, flag: bool) -> None:
    """A PUT's write: into `memo` while its indices stay 0, 1, 2..., into `sparse` (all of the memo
    moved there) from the first that skips one."""
    if sparse:
        sparse[index] = flag
    elif index < len(memo):
        memo[index] = flag
    elif index == len(memo):
        memo.append(flag)
    else:
        sparse.update(enumerate(memo))
        sparse[index] = flag


def _truncated(code: int) -> TrxpError:
    return TrxpError(f"metadata: pickle is truncated in {_OPCODE_NAMES[code]}")


def _empty_stack(code: int) -> TrxpError:
    return TrxpError(f"metadata: pickle {_OPCODE_NAMES[code]} finds an empty stack")


def _never_stored(code: int, memo_index: int) -> TrxpError:
    return TrxpError(f"metadata: pickle {_OPCODE_NAMES[code]} reads memo entry {memo_index}, which was never stored")


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
