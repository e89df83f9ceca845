"""The head of a tensor section stored in chunks (chunked.py): its frame, read and packed, its
own digest, and the keys of its chunk set.

An experience whose tensor section is larger than CHUNK_BYTES keeps in `blobs` a head, and
its section in `chunks`, CHUNK_BYTES a value (the last one shorter), keyed by its table's id,
the number of its chunk set and each chunk's number. The head is the payload's bytes up to
its section (the TRXP header, the metadata pickle, the safetensors header) behind a small
frame: b"TRXO" · chunk set u64 · the head's own digest · section length u64 · chunk bytes
u32 · chunks u32 · each chunk's XXH3-128 digest (16 bytes). The head's own digest is of its
chunk set and of everything after the digest (format 9; format 8's left the set out, and a set
number damaged into another's took that experience's chunks with it when the damaged one was
deleted). The head of a section whose chunks are zstd frames (a table that compresses) has the
magic b"TRXZ"; its chunks' digests stay those of the bytes as pushed, checked once decompressed.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zstandard

from expbuf.client.trxp.stored.pieces import Bytes

from . import digests
from .layout import U32
from .zstd_workers import Workers

CHUNK_BYTES = 4 << 20
HEAD_MAGIC = b"TRXO"
ZSTD_MAGIC = b"TRXZ"  # a head whose chunks are zstd frames
_MAGICS = (HEAD_MAGIC, ZSTD_MAGIC)
_MAGIC_SET, _FIRST_FOUR = frozenset(_MAGICS), operator.itemgetter(slice(0, 4))
FRAME = struct.Struct("<4sQ16sQII")  # magic, chunk set, the head's digest, section length, chunk bytes, chunks
_SET = slice(4, 12)  # the head's chunk set, which its own digest covers ...
DIGESTED = 4 + 8 + 16  # ... with the bytes from its section length on
SET_NUMBER = struct.Struct(">Q")  # a chunk set's number, in its chunks' keys and as the next to take
# The number under which a stored set keeps the key of the experience it holds the data of (the
# last of its set): a damaged or lost head's own set is found by it, whatever its damage (chunked.delete).
OWNER = 0xFFFFFFFF
DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class ChunkHead:
    """A head as stored: its chunk set, section length, chunk size, the chunks' digests and
    the payload's bytes before its section; `intact` whether they are those its own digest names;
    `compressed` whether its chunks are zstd frames."""

    set_id: int
    section_len: int
    chunk_bytes: int
    digests: tuple[bytes, ...]
    prefix: memoryview
    intact: bool
    compressed: bool = False

    @property
    def chunks(self) -> int:
        return len(self.digests)

    def span(self, start: int, end: int) -> range:
        """The chunks that bytes `start` to `end` of the section lie in."""
        return range(start // self.chunk_bytes, -(-end // self.chunk_bytes)) if end > start else range(0)

    def length(self, index: int) -> int:
        """How many bytes of the section chunk `index` holds."""
        return min(self.chunk_bytes, self.section_len - index * self.chunk_bytes)

    def plain_each(
        self, indices: Sequence[int], stored: Sequence[Bytes | None], workers: Workers | None = None
    ) -> list[Bytes | None]:
        """`plain` of chunk `indices[i]` from `stored[i]`, for each: on this thread, or several
        frames side by side on `workers`."""
        if not self.compressed:
            return list(stored)
        if workers is None:
            return [self.plain(index, chunk) for index, chunk in zip(indices, stored, strict=True)]
        return workers.each(self.plain, indices, stored)

    def plain(self, index: int, stored: Bytes | None) -> Bytes | None:
        """Chunk `index`'s bytes as pushed, from its stored value: itself, or its zstd frame
        decompressed. None where it is missing, or is a frame that does not say it holds the
        chunk's length or does not decompress (damage, which its digest check then names)."""
        if stored is None or not self.compressed:
            return stored
        try:
            if zstandard.frame_content_size(stored) != self.length(index):
                return None
            plain: bytes = zstandard.ZstdDecompressor().decompress(stored)
        except zstandard.ZstdError:
            return None
        return plain


def is_head(value: Bytes) -> bool:
    return value[:4] in _MAGICS


def any_head(values: Iterable[Bytes]) -> bool:
    """Whether any of these values is a head (`is_head`): their first bytes read in C."""
    return not _MAGIC_SET.isdisjoint(map(_FIRST_FOUR, values))


def read_head(value: Bytes) -> ChunkHead:
    """A head's fields; ValueError when its frame is not whole (damage)."""
    view = memoryview(value)
    magic, set_id, own, section_len, chunk_bytes, count = FRAME.unpack_from(view)
    table_end = FRAME.size + DIGEST_BYTES * count
    if magic not in _MAGICS or len(view) < table_end or not chunk_bytes or count != -(-section_len // chunk_bytes):
        raise ValueError("a head of a section stored in chunks whose frame is damaged")
    found = tuple(bytes(view[at : at + DIGEST_BYTES]) for at in range(FRAME.size, table_end, DIGEST_BYTES))
    intact = own_digest(view) == own
    return ChunkHead(set_id, section_len, chunk_bytes, found, view[table_end:], intact, magic == ZSTD_MAGIC)


def own_digest(head: memoryview) -> bytes:
    """The digest a head keeps of itself: of its chunk set and of its bytes after the digest."""
    hasher = digests.running()
    hasher.update(head[_SET])
    hasher.update(head[DIGESTED:])
    return hasher.digest()


def format_8(value: Bytes) -> tuple[int, bool] | None:
    """The chunk set a head as format 8 wrote it names, and whether it matches its format 8 digest
    (of its bytes after the digest alone); None for a value that is no head, or whose frame does
    not read."""
    view = memoryview(value)
    if len(view) < FRAME.size or not is_head(view):
        return None
    try:
        set_id = read_head(view).set_id
    except (ValueError, struct.error):
        return None
    return set_id, digests.of(view[DIGESTED:]) == view[12:DIGESTED]


def pack_head(
    set_id: int, section_len: int, chunk_digests: Sequence[bytes], prefix: Sequence[Bytes], compressed: bool = False
) -> bytes:
    """A head of a section stored in `len(chunk_digests)` chunks of CHUNK_BYTES (zstd frames of
    them, `compressed`): its frame, its chunks' digests and the payload's bytes before the
    section, under a digest of its own, so a read of some of its chunks (some fields: Deferred)
    trusts the head it finds them by."""
    magic = ZSTD_MAGIC if compressed else HEAD_MAGIC
    frame = FRAME.pack(magic, set_id, bytes(DIGEST_BYTES), section_len, CHUNK_BYTES, len(chunk_digests))
    head = bytearray(b"".join([frame, *chunk_digests, *prefix]))
    head[12:DIGESTED] = own_digest(memoryview(head))
    return bytes(head)


def set_prefix(table_prefix: bytes, set_id: int) -> bytes:
    return table_prefix + SET_NUMBER.pack(set_id)


def chunk_key(table_prefix: bytes, set_id: int, index: int) -> bytes:
    return table_prefix + SET_NUMBER.pack(set_id) + U32.pack(index)


def intact_head(value: Bytes) -> ChunkHead | None:
    """The head a value is, where its frame reads and its own digest matches; None for any other."""
    if len(value) < FRAME.size or not is_head(value):
        return None
    try:
        head = read_head(value)
    except (ValueError, struct.error):
        return None
    return head if head.intact else None
