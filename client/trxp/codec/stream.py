"""A payload read as it arrives: its items checked from its head alone, and the tensor data of
its large items handed on in chunks as the bytes come, so that a push never holds them whole.

A server reading a push in chunks (server/rpc/push/push_memory.py) parses the payload's head (its TRXP
header, metadata and safetensors header: parse.parse_head) from the first chunk, before any
tensor data, within the budgets of that chunk's bytes (a head that needs more is read whole,
with the budgets of all that was sent). An item whose tensor data is larger than `chunk_bytes`
is large: its data, laid out as the store keeps it (pack_item's order), goes out in pieces of
`chunk_bytes` as the payload's data arrives (`feed`), each piece filled once, in place, and its
action mask's generated tokens are counted as they pass (`generated`); the others' data is kept
to the end (`finish`). Every item's token-level rewards, which the head's checks cannot read, are
checked as they pass (NaN, infinity, beyond float32: TrxpError, as a payload read whole is
refused). A payload with no large item, or whose large items' data does not come in the order
the store keeps it (no client that builds TRXP as Trinity-RFT does sends one), is not for
streaming: `NotStreamable`, and the caller reads it whole.
"""

from __future__ import annotations

import math

from .build import pack_head
from .checks import check_rewards
from .common import ITEMSIZE, MetadataLimit, RawItem, RawTensor, count_nonzero
from .parse import head_length, parse_head

Run = bytes | memoryview
# A piece of a large item's tensor data, as the store keeps it: (item, piece number, bytes).
Piece = tuple[int, int, memoryview]


class NotStreamable(Exception):
    """A payload that is read whole: no large item, or data out of the store's order."""


# A payload's head read: its length, its items (each tensor an empty view) and where each tensor's
# data lies in the data after the head, in the data's order (parse_head's places).
Head = tuple[int, list[RawItem], list[tuple[int, int, int, str]]]


class StreamedPayload:
    """One payload of `size` bytes whose head is whole in `start` (its first bytes); `feed`
    the rest of it, its bytes after the head, in order, then `finish`. A TRXP payload's head is
    read here; another layout's (a batch of columns: column_batch/wire.head) is given as `head`."""

    def __init__(
        self,
        start: memoryview,
        size: int,
        chunk_bytes: int,
        *,
        limit: MetadataLimit | None = None,
        head: Head | None = None,
    ) -> None:
        if head is None:
            length = head_length(start, size)
            if not length or length > len(start):
                raise NotStreamable("the payload's head is not whole in its first chunk")
            items, places = parse_head(start[:length], size, received=len(start), limit=limit)
            head = length, items, places
        self.head_length, self.items, places = head
        self.chunk_bytes = chunk_bytes
        sizes = [sum(_nbytes(tensor) for tensor in item.tensors.values()) for item in self.items]
        self.large = [index for index, total in enumerate(sizes) if total > chunk_bytes]
        if not self.large:
            raise NotStreamable("no item's tensor data is larger than a chunk")
        self.heads: dict[int, list[Run]] = {}
        for index in self.large:
            self.heads[index], order = pack_head(self.items[index])
            arrives = [name for _, _, item, name in places if item == index]
            if arrives != order:
                raise NotStreamable(f"item {index}'s tensor data does not come in the order the store keeps it")
        self.section_lengths = {index: sizes[index] for index in self.large}
        large = set(self.large)
        # Each large item's response tokens under its action mask, counted as the mask passes.
        self.generated = {index: self.items[index].response_length for index in self.large}
        # Where each tensor's bytes go, in the data's order: (end, item, name, the bytes kept of it:
        # -1 for a large item's, which go into pieces).
        self._spans: list[tuple[int, int, str, int]] = []
        for _, end, item, name in places:
            self._spans.append((end, item, name, -1 if item in large else _nbytes(self.items[item].tensors[name])))
            if item in large and name == "action_mask":
                self.generated[item] = 0
        # A kept tensor's buffer (by its span), made as its first byte comes: a push in chunks opens
        # this before it reserves what it `holds` under max_inflight_bytes, and waits for room.
        self._kept: dict[int, bytearray] = {}
        self._carry = b""  # the bytes of an element (a mask's, a reward's) that a feed cut in two
        self._span = 0
        self._at = 0  # bytes of the data seen
        self._kept_at = 0  # where the current kept tensor is filled to
        self._piece: dict[int, tuple[bytearray, int, int]] = {}  # large item: its piece, filled to, number

    @property
    def holds(self) -> int:
        """The most this payload holds at once: its head, the data of its items that are not
        large, a piece per large item."""
        kept = sum(size for *_, size in self._spans if size > 0)
        return self.head_length + kept + len(self.large) * self.chunk_bytes

    def feed(self, data: Run) -> list[Piece]:
        """Take the next bytes of the data; the pieces of large items they fill."""
        view = memoryview(data).cast("B")
        done: list[Piece] = []
        pos = 0
        while pos < len(view):
            if self._span >= len(self._spans):
                raise ValueError("more tensor data than the payload's head declares")
            end, item, name, size = self._spans[self._span]
            take = min(len(view) - pos, end - self._at)
            part = view[pos : pos + take]
            if size >= 0:
                buffer = self._kept.get(self._span)
                if buffer is None:
                    buffer = self._kept[self._span] = bytearray(size)
                buffer[self._kept_at : self._kept_at + take] = part
                self._kept_at += take
            if name == "token_level_reward":
                self._check_rewards(item, part)
            if item in self.heads:
                if name == "action_mask":
                    self._count(item, part)
                self._to_piece(item, part, done)
            pos += take
            self._at += take
            if self._at == end:
                self._span += 1
                self._kept_at = 0
        return done

    def _count(self, item: int, part: memoryview) -> None:
        """Count a large item's generated tokens in the next bytes of its action mask."""
        self.generated[item] += count_nonzero(self._elements(item, "action_mask", part))

    def _check_rewards(self, item: int, part: memoryview) -> None:
        """Refuse an item's token-level rewards in the next bytes of them (checks.check_rewards)."""
        check_rewards(item, self.items[item], self._elements(item, "token_level_reward", part))

    def _elements(self, item: int, name: str, part: memoryview) -> RawTensor:
        """The whole elements of the item's tensor `name` in the next bytes of it, those of one a
        feed cut in two carried to the next (a tensor's data is whole elements: none at its end)."""
        dtype = self.items[item].tensors[name].dtype
        data = memoryview(self._carry + part) if self._carry else part
        whole = len(data) - len(data) % ITEMSIZE[dtype]
        self._carry = bytes(data[whole:])
        return RawTensor(dtype, (whole // ITEMSIZE[dtype],), data[:whole])

    def _to_piece(self, item: int, part: memoryview, done: list[Piece]) -> None:
        at = 0
        while at < len(part):
            piece, filled, number = self._piece.get(item) or (bytearray(self.chunk_bytes), 0, 0)
            take = min(len(part) - at, self.chunk_bytes - filled)
            piece[filled : filled + take] = part[at : at + take]
            filled += take
            at += take
            if filled == self.chunk_bytes:
                done.append((item, number, memoryview(piece)))
                self._piece[item] = (bytearray(self.chunk_bytes), 0, number + 1)
            else:
                self._piece[item] = (piece, filled, number)

    def finish(self) -> list[Piece]:
        """The last pieces of the large items (each shorter than a chunk); the items' kept tensors
        now hold their data. ValueError if the data ended early."""
        while self._span < len(self._spans) and self._spans[self._span][0] == self._at:
            self._span += 1  # empty tensors at the end of the data, which no byte fed stepped past
        if self._span < len(self._spans):
            raise ValueError("the payload ended before the tensor data its head declares")
        last: list[Piece] = []
        for item, (piece, filled, number) in sorted(self._piece.items()):
            if filled:
                last.append((item, number, memoryview(piece)[:filled]))
        self._piece.clear()
        for span, (_, item, name, size) in enumerate(self._spans):
            if size >= 0:  # an empty tensor's buffer: none came
                buffer = self._kept.pop(span, None) or bytearray(size)
                tensor = self.items[item].tensors[name]
                self.items[item].tensors[name] = RawTensor(tensor.dtype, tensor.shape, memoryview(buffer))
        return last


def _nbytes(tensor: RawTensor) -> int:
    return math.prod(tensor.shape) * ITEMSIZE[tensor.dtype]
