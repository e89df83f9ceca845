"""Tensor sections stored out of line, in chunks: no push, read or commit holds a large
experience whole.

An experience whose tensor section is larger than CHUNK_BYTES keeps in `blobs` a head, and
its section in `chunks`, CHUNK_BYTES a value (the last one shorter), keyed by its table's id,
the number of its chunk set and each chunk's number. The head is the payload's bytes up to
its section (the TRXP header, the metadata pickle, the safetensors header) behind a small
frame: b"TRXO" · chunk set u64 · the head's own digest · section length u64 · chunk bytes
u32 · chunks u32 · each chunk's XXH3-128 digest (16 bytes). The head's own digest is of its
chunk set and of everything after the digest (format 9; format 8's left the set out, and a set
number damaged into another's took that experience's chunks with it when the damaged one was
deleted). A table that compresses (its setting `compression`) keeps so every section larger
than MIN_COMPRESSED, each chunk a zstd frame of its bytes, compressed before the writer takes
it, its head's magic b"TRXZ"; the digests stay those of the bytes as pushed, checked once
decompressed. Read back, a head and its chunks are a `pieces.SplitPayload`, the same bytes as
the one-item payload stored whole would be, which the record's digest is taken over
(digests.of): a retried push is a duplicate however its experience was stored.

A push in chunks stages its experiences' sections as they arrive (rpc/ingest.py): each chunk
is written under a set marked in `staged` (`stage`), in the writer's commits; the push's commit
writes the heads and unmarks their sets (`stored_value`), a push that fails drops them
(`drop_set`), and an open drops the sets that a stopped server left staged (`sweep_staged`). A
set number is never used twice (the next is kept in `meta`, `reserve_sets`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import struct
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb
import zstandard

from expbuf.client.trxp.build import json_text, stored_entries
from expbuf.client.trxp.columns import Shares, token_count
from expbuf.client.trxp.pieces import Bytes, Run, SplitPayload, Stored, Window, parts_of, section_at

from ..schema.errors import DamagedPayload, NotFound, clip
from . import digests, shared_prompts
from .layout import micros
from .records import ItemRecord
from .shared_prompts import Read

if TYPE_CHECKING:
    from .snapshot import Snapshot

CHUNK_BYTES = 4 << 20
# A table that compresses keeps in chunks, as frames, a section larger than this (one of up to
# CHUNK_BYTES in one chunk): rollouts of a few thousand tokens with MoE routing ids are 1-4 MiB.
MIN_COMPRESSED = 256 << 10
HEAD_MAGIC = b"TRXO"
ZSTD_MAGIC = b"TRXZ"  # a head whose chunks are zstd frames
_MAGICS = (HEAD_MAGIC, ZSTD_MAGIC)
_FRAME = struct.Struct("<4sQ16sQII")  # magic, chunk set, the head's digest, section length, chunk bytes, chunks
_SET = slice(4, 12)  # the head's chunk set, which its own digest covers ...
_DIGESTED = 4 + 8 + 16  # ... with the bytes from its section length on
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_NEXT_SET = b"next_chunk_set"  # in meta: the number the next chunk set takes
# The number under which a stored set keeps the key of the experience it holds the data of (the
# last of its set): a damaged head's own set is found by it, whatever its damage (`delete`).
OWNER = 0xFFFFFFFF
DIGEST_BYTES = 16
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Head:
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


class Staging:
    """A large item's section as a push in chunks stages it (`stage`): its chunk set, its chunks'
    digests and the digest of its whole payload (its `prefix`, then the section), taken as the
    chunks pass, over their bytes as pushed; then its head."""

    def __init__(self, prefix: Sequence[Bytes], section_len: int) -> None:
        self.prefix, self.section_len = list(prefix), section_len
        self.set_id: int | None = None
        self.level: int | None = None  # the zstd level its chunks are staged at; None: as they are
        self.digests: list[bytes] = []
        self._whole = digests.running()
        for run in self.prefix:
            self._whole.update(run)

    def add(self, chunk: Bytes) -> None:
        """The next chunk of the section, staged."""
        self.digests.append(digests.of(chunk))
        self._whole.update(chunk)

    @property
    def size(self) -> int:
        return sum(map(len, self.prefix)) + self.section_len

    def digest(self) -> bytes:
        return self._whole.digest()

    def head(self) -> bytes:
        assert self.set_id is not None, "a head names the set its chunks were staged in"
        return pack_head(self.set_id, self.section_len, self.digests, self.prefix, self.level is not None)


class Workers:
    """A few threads, made at first use, for one kind of zstd work: zstd lets go of the
    interpreter while it compresses or decompresses a chunk, so a large experience's chunks go
    at the speed of the server's cores, not of one. Pushes' compression and replies'
    decompression each have their own, so that neither waits behind the other; the writer,
    and every other read, decompresses on its own thread."""

    def __init__(self, name: str) -> None:
        self._name, self._lock = name, threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._threads = min(8, _cores())

    def each(self, work: Callable[..., T], *over: Sequence[Any]) -> list[T]:
        """`work` over the items of `over` (zipped), side by side where there are several; every
        one done before this returns (or raises the first failure). A call has at most as many
        in the pool at once as it has threads, the next going in as one ends: the calls of
        several tables share the threads in turn, where a table compressing at level 19 would
        have held a level-1 table's push behind all of its chunks."""
        items = list(zip(*over, strict=True))
        if len(items) < 2:
            return [work(*item) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=self._name)
            pool = self._pool
        futures: list[Future[T]] = []
        running: set[Future[T]] = set()
        try:
            for item in items:
                if len(running) >= self._threads:
                    _, running = wait(running, return_when=FIRST_COMPLETED)
                future = pool.submit(work, *item)
                futures.append(future)
                running.add(future)
        finally:
            wait(futures)  # none still reads the caller's views once it has left
        return [future.result() for future in futures]


def _cores() -> int:
    """The cores this process may run on (all of the machine's where the platform cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


COMPRESSING = Workers("expbuf-zstd-push")  # a push's chunks, compressed before the writer
DECOMPRESSING = Workers("expbuf-zstd-reply")  # a reply's chunks, decompressed where it is built


def is_head(value: Bytes) -> bool:
    return value[:4] in _MAGICS


def compress(chunk: Bytes, level: int) -> bytes:
    """A chunk as a table that compresses keeps it: one zstd frame, which says its length."""
    frame: bytes = zstandard.ZstdCompressor(level=level).compress(chunk)
    return frame


def read_head(value: Bytes) -> Head:
    """A head's fields; ValueError when its frame is not whole (damage)."""
    view = memoryview(value)
    magic, set_id, own, section_len, chunk_bytes, count = _FRAME.unpack_from(view)
    table_end = _FRAME.size + DIGEST_BYTES * count
    if magic not in _MAGICS or len(view) < table_end or not chunk_bytes or count != -(-section_len // chunk_bytes):
        raise ValueError("a head of a section stored in chunks whose frame is damaged")
    found = tuple(bytes(view[at : at + DIGEST_BYTES]) for at in range(_FRAME.size, table_end, DIGEST_BYTES))
    intact = _own_digest(view) == own
    return Head(set_id, section_len, chunk_bytes, found, view[table_end:], intact, magic == ZSTD_MAGIC)


def _own_digest(head: memoryview) -> bytes:
    """The digest a head keeps of itself: of its chunk set and of its bytes after the digest."""
    hasher = digests.running()
    hasher.update(head[_SET])
    hasher.update(head[_DIGESTED:])
    return hasher.digest()


def _format_8(value: Bytes) -> tuple[int, bool] | None:
    """The chunk set a head as format 8 wrote it names, and whether it matches its format 8 digest
    (of its bytes after the digest alone); None for a value that is no head, or whose frame does
    not read."""
    view = memoryview(value)
    if len(view) < _FRAME.size or not is_head(view):
        return None
    try:
        set_id = read_head(view).set_id
    except (ValueError, struct.error):
        return None
    return set_id, digests.of(view[_DIGESTED:]) == view[12:_DIGESTED]


def _chunks_match(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, value: Bytes) -> bool:
    """Whether the chunks of the set a head names are those its digests name, one read at a time."""
    head = read_head(value)
    for index, stored in enumerate(_stored_chunks(head, key, reader(txn, dbs))):
        chunk = head.plain(index, stored)
        if chunk is None or digests.of(chunk) != head.digests[index]:
            return False
    return True


def reseal_heads(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> int:
    """Format 9's step, in the open's transaction: each head of a format 6 to 8 directory gets its
    own digest over its chunk set too, and its set a mark with its key (`own`). Format 8's digest
    left the set out, so a head whose set number was damaged into another's still matched it: a
    set that several heads name goes to the one whose digest matches and whose chunks match its
    digests, if exactly one does (none otherwise: two heads may name the same bytes), the others
    left as they are, damaged. A head that does not match its digest is left damaged, its set
    marked as its where no other head names it; a set without chunks is given to none. Only the
    payloads whose records say they are larger than MIN_COMPRESSED are read (a head stands for
    one), so the upgrade of many small experiences reads their records, not their payloads.
    Returns how many heads were resealed."""
    claims: dict[tuple[bytes, int], list[tuple[bytes, bool]]] = {}
    with txn.cursor(db=dbs["items"]) as cur:  # the records say which payloads may be heads
        for key, record in cur:
            if ItemRecord.place(record)[2] <= MIN_COMPRESSED:  # stored whole: the blob is not read
                continue
            value = txn.get(key, db=dbs["blobs"])
            found = None if value is None else _format_8(value)
            if found is not None:
                claims.setdefault((bytes(key[:4]), found[0]), []).append((bytes(key), found[1]))
    resealed = 0
    head_of = partial(_present, txn, dbs["blobs"])
    for (prefix, set_id), heads in claims.items():
        with txn.cursor(db=dbs["chunks"]) as cur:
            if not (cur.set_range(set_prefix(prefix, set_id)) and cur.key()[:12] == set_prefix(prefix, set_id)):
                continue
        if len(heads) > 1:
            heads = [(key, True) for key, matches in heads if matches and _chunks_match(txn, dbs, key, head_of(key))]
            if len(heads) != 1:
                continue
        ((key, matches),) = heads
        if matches:
            view = memoryview(head_of(key))
            txn.put(key, b"".join([view[:12], _own_digest(view), view[_DIGESTED:]]), db=dbs["blobs"])
            resealed += 1
        own(txn, dbs, key, set_id)
    return resealed


def _present(txn: lmdb.Transaction[bytes], db: lmdb._Database, key: bytes) -> bytes:
    """A value known to be stored."""
    value = txn.get(key, db=db)
    assert value is not None, "a value read in this very transaction"
    return value


def pack_head(
    set_id: int, section_len: int, chunk_digests: Sequence[bytes], prefix: Sequence[Bytes], compressed: bool = False
) -> bytes:
    """A head of a section stored in `len(chunk_digests)` chunks of CHUNK_BYTES (zstd frames of
    them, `compressed`): its frame, its chunks' digests and the payload's bytes before the
    section, under a digest of its own, so a read of some of its chunks (some fields: Deferred)
    trusts the head it finds them by."""
    magic = ZSTD_MAGIC if compressed else HEAD_MAGIC
    frame = _FRAME.pack(magic, set_id, bytes(DIGEST_BYTES), section_len, CHUNK_BYTES, len(chunk_digests))
    head = bytearray(b"".join([frame, *chunk_digests, *prefix]))
    head[12:_DIGESTED] = _own_digest(memoryview(head))
    return bytes(head)


def set_prefix(table_prefix: bytes, set_id: int) -> bytes:
    return table_prefix + _U64.pack(set_id)


def chunk_key(table_prefix: bytes, set_id: int, index: int) -> bytes:
    return table_prefix + _U64.pack(set_id) + _U32.pack(index)


def reserve_sets(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], count: int = 1) -> int:
    """The first of `count` chunk set numbers no one has used, from now on used."""
    raw = txn.get(_NEXT_SET, db=dbs["meta"])
    set_id = 1 if raw is None else _U64.unpack(raw)[0]
    txn.put(_NEXT_SET, _U64.pack(set_id + count), db=dbs["meta"])
    return set_id


def stored_value(
    sharing: shared_prompts.Sharing,
    key: bytes,
    blob: bytes,
    response: int,
    prompt_bytes: int,
    chunks: Sequence[bytes] = (),
) -> bytes:
    """What `blobs` keeps under `key` for a pushed experience's payload (of `response` response
    tokens after `prompt_bytes` of prompt tokens), in the push's transaction (`sharing`'s): the
    payload itself, or a reference to its prompt stored once (shared_prompts.py), or, for one whose
    section is larger than CHUNK_BYTES, its head, its section written to a new chunk set here; a
    head staged by a push in chunks is kept as it is, its set no longer staged (NotFound where its
    set is not staged in this table: the table was dropped while the push was read), and a head
    made with its `chunks` (compressed) has them written here. A payload whose prompt is too short to
    share is kept as it is without a look at its header."""
    txn, dbs = sharing.txn, sharing.dbs
    if is_head(blob):
        set_id = read_head(blob).set_id
        for index, frame in enumerate(chunks):
            txn.put(chunk_key(bytes(key[:4]), set_id, index), frame, db=dbs["chunks"])
        if not chunks and not txn.delete(set_prefix(bytes(key[:4]), set_id), db=dbs["staged"]):
            raise NotFound(
                f"the data of experience {clip(bytes(key[4:]).decode())} staged as its push arrived is gone: its "
                "table was dropped (and made again) while the push was read; push it again"
            )
        own(txn, dbs, key, set_id)
        return blob
    view = memoryview(blob)
    start = section_at(view) if len(blob) > CHUNK_BYTES else len(blob)  # a small one's section is not read
    if len(view) - start <= CHUNK_BYTES:  # kept in one value
        return sharing.value(key, blob, response) if prompt_bytes >= shared_prompts.MIN_BYTES else blob
    section = view[start:]
    set_id = reserve_sets(txn, dbs)
    found = []
    for index, chunk in enumerate(cut(section)):
        txn.put(chunk_key(bytes(key[:4]), set_id, index), chunk, db=dbs["chunks"])
        found.append(digests.of(chunk))
    own(txn, dbs, key, set_id)
    return pack_head(set_id, len(section), found, [view[:start]])


def own(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, set_id: int) -> None:
    """Mark a chunk set as the data of the experience stored under `key`."""
    txn.put(chunk_key(bytes(key[:4]), set_id, OWNER), bytes(key), db=dbs["chunks"])


def _marked(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, head: Head) -> bool:
    """Whether the set a head names is marked as the data of the experience under `key`."""
    mark = txn.get(chunk_key(bytes(key[:4]), head.set_id, OWNER), db=dbs["chunks"])
    return mark is not None and bytes(mark) == bytes(key)


def _sets_of(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes) -> list[int]:
    """The chunk sets marked as the data of the experience under `key`: a walk over its table's
    sets, a seek or two each, for a head that cannot be trusted to name its own (damaged, rare)."""
    prefix, found = bytes(key[:4]), []
    with txn.cursor(db=dbs["chunks"]) as cur:
        present = cur.set_range(prefix)
        while present and bytes(cur.key()[:4]) == prefix:
            set_id = _U64.unpack(cur.key()[4:12])[0]
            if cur.set_key(chunk_key(prefix, set_id, OWNER)) and bytes(cur.value()) == bytes(key):
                found.append(set_id)
            present = cur.set_range(set_prefix(prefix, set_id + 1))
    return found


def cut(section: memoryview) -> list[Bytes]:
    """A section's chunks: CHUNK_BYTES each, the last one shorter."""
    return [section[at : at + CHUNK_BYTES] for at in range(0, len(section), CHUNK_BYTES)]


def compressed(
    blobs: Sequence[bytes | None], level: int, new_set: Callable[[], int]
) -> list[tuple[bytes, list[bytes]] | None]:
    """Pushed payloads as a table that compresses keeps them, made before the writer takes them:
    for each, the head of its section in a new set (`new_set()`) and its chunks, each a zstd
    frame, every chunk of them compressed side by side (COMPRESSING); None for one whose section
    is MIN_COMPRESSED or less (kept as stored_value keeps it), one that is a head already
    (staged), and one given as None."""
    sections: list[tuple[memoryview, memoryview] | None] = []  # (bytes before the section, section)
    for blob in blobs:
        view = None if blob is None or len(blob) <= MIN_COMPRESSED or is_head(blob) else memoryview(blob)
        start = 0 if view is None else section_at(view)
        sections.append(None if view is None or len(view) - start <= MIN_COMPRESSED else (view[:start], view[start:]))
    pieces = [[] if found is None else cut(found[1]) for found in sections]
    frames = iter(COMPRESSING.each(partial(compress, level=level), [chunk for chunks in pieces for chunk in chunks]))
    made: list[tuple[bytes, list[bytes]] | None] = []
    for found, chunks in zip(sections, pieces, strict=True):
        if found is None:
            made.append(None)
            continue
        head = pack_head(new_set(), len(found[1]), [digests.of(c) for c in chunks], [found[0]], compressed=True)
        made.append((head, [next(frames) for _ in chunks]))
    return made


def stage(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    table_prefix: bytes,
    set_id: int,
    index: int,
    chunk: Bytes,
    now: float,
) -> None:
    """Write one chunk of a section a push in chunks is staging, in a set (reserve_sets) marked
    staged until the push's commit by its first chunk, which is written first. A later chunk
    whose set is not marked in this table is refused NotFound: the table was dropped (and made
    again) since the first, which went with it."""
    mark = set_prefix(table_prefix, set_id)
    if index == 0:
        txn.put(mark, micros(now), db=dbs["staged"], overwrite=False)
    elif txn.get(mark, db=dbs["staged"]) is None:
        raise NotFound("the table was dropped (and made again) while the push was read; push it again")
    txn.put(chunk_key(table_prefix, set_id, index), chunk, db=dbs["chunks"])


def drop_set(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], table_prefix: bytes, set_id: int) -> None:
    """A chunk set's chunks and its staged mark go."""
    start = set_prefix(table_prefix, set_id)
    with txn.cursor(db=dbs["chunks"]) as cur:
        found = cur.set_range(start)
        while found and cur.key()[: len(start)] == start:
            found = cur.delete()
    txn.delete(start, db=dbs["staged"])


def sweep_staged(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> int:
    """Drop every staged set: a push that was staging when its server stopped never completes.
    Returns how many went."""
    with txn.cursor(db=dbs["staged"]) as cur:
        keys = [bytes(key) for key in cur.iternext(values=False)]
    for key in keys:
        drop_set(txn, dbs, bytes(key[:4]), _U64.unpack(key[4:12])[0])
    return len(keys)


def staged_sets(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> int:
    return int(txn.stat(dbs["staged"])["entries"])


def resolve(value: Bytes, key: bytes | memoryview, read: Read) -> Stored:
    """A stored value as the payload it stands for: itself, a reference's payload with its shared
    prompt (shared_prompts.py), or a head's prefix and its chunks, read with `read` (a
    database's name and a key to the value). A chunk that is missing reads as nothing and a
    head whose frame, or whose own digest, is damaged as its bytes, which the read check then
    finds do not match."""
    if len(value) >= 4 and shared_prompts.is_ref(value):
        return shared_prompts.resolve(value, key, read)
    head = _intact_head(value)
    if head is None:
        return value
    plain = head.plain_each(range(head.chunks), _stored_chunks(head, key, read))
    return SplitPayload(head.prefix, [b"" if chunk is None else chunk for chunk in plain])


def _intact_head(value: Bytes) -> Head | None:
    """The head a value is, where its frame reads and its own digest matches; None for any other."""
    if len(value) < _FRAME.size or not is_head(value):
        return None
    try:
        head = read_head(value)
    except (ValueError, struct.error):
        return None
    return head if head.intact else None


def _stored_chunks(head: Head, key: bytes | memoryview, read: Read) -> list[Bytes | None]:
    """A head's chunks as stored (None where one is missing)."""
    prefix = bytes(key[:4])
    return [read("chunks", chunk_key(prefix, head.set_id, index)) for index in range(head.chunks)]


def streamed(value: Bytes, key: bytes | memoryview, read: Read) -> tuple[bytes, int] | None:
    """The digest and length of the payload an intact head of zstd frames stands for, its chunks
    decompressed one at a time, so that a check of it (the scrub's) holds one chunk, not the
    payload: a chunk missing or that does not decompress adds nothing. None for any other value
    (read it whole with `resolve`)."""
    head = _intact_head(value)
    if head is None or not head.compressed:
        return None
    whole, size = digests.running(), len(head.prefix)
    whole.update(head.prefix)
    for index, stored in enumerate(_stored_chunks(head, key, read)):  # decompressed one at a time
        chunk = head.plain(index, stored)
        if chunk is not None:
            whole.update(chunk)
            size += len(chunk)
    return whole.digest(), size


# What a reply of these fields reads besides them: the action mask, which advantages of one value
# an experience are spread under (stored_advantages.expand).
_READS_MASK = frozenset({"advantages", "returns"})
_ZEROS = memoryview(bytes(CHUNK_BYTES))  # stands for a chunk a reply does not read: never read


class Deferred:
    """A payload stored in chunks, taken by its head alone in the writer's transaction: its chunks
    are read from the snapshot the batch was taken in, and checked, where the batch's reply is
    built (`resolve`), off the writer, so that a take of long rollouts never holds the writer
    while their bytes are read from disk and digested. A reply of some fields reads only the
    chunks they lie in. Should the snapshot have to end first (a map resize), `detach` copies the
    head and the chunks out of it."""

    __slots__ = ("_chunk", "_copied", "_head", "_key", "digest", "size", "uid")

    def __init__(self, uid: str, head: Head, key: bytes, digest: bytes, size: int, read: Read) -> None:
        self.uid, self._head, self._key, self.digest, self.size = uid, head, key, digest, size
        self._chunk = partial(read, "chunks")
        self._copied: list[Bytes | None] | None = None  # the chunks, once detached

    @property
    def head(self) -> Head:
        """Its head as stored: what it holds, before its chunks are read."""
        return self._head

    def _stored(self, index: int) -> Bytes | None:
        if self._copied is not None:
            return self._copied[index]
        return self._chunk(chunk_key(bytes(self._key[:4]), self._head.set_id, index))

    def _plain(self, indices: Sequence[int]) -> dict[int, Bytes | None]:
        """Chunks' bytes as pushed (Head.plain_each), by their numbers."""
        stored = [self._stored(index) for index in indices]
        return dict(zip(indices, self._head.plain_each(indices, stored, DECOMPRESSING), strict=True))

    def checked_chunk(self, index: int) -> Bytes:
        """Chunk `index`'s bytes as pushed, checked against its digest (DamagedPayload if not)."""
        got = self._head.plain(index, self._stored(index))
        if got is None or len(got) != self._head.length(index) or digests.of(got) != self._head.digests[index]:
            raise DamagedPayload(self.uid, f"chunk {index} of its data does not match its digest")
        return got

    def resolve(
        self, fields: Collection[str] | None = None, shares: Shares | None = None, response: int = 0
    ) -> SplitPayload:
        """The payload, checked: all of it against its record's digest; or, given the fields a
        reply reads, its head against the head's own digest and the chunks those fields lie in
        against theirs, the others standing as zeros no reply reads. With `shares` (the
        experience's response being `response` tokens), only the chunks of the rows in them.
        DamagedPayload if what is read is not what was pushed. A head of zstd frames whose own
        digest matches gives its chunks as Windows of Frames: each decompressed, and checked
        against its digest in the head, as the part of a reply that holds it is cut (the head's
        digest names theirs: what they check together is the payload pushed), so that a reply
        holds a chunk or two of them at a time, not the batch's."""
        head = self._head
        if head.compressed:
            if not head.intact:
                raise DamagedPayload(
                    self.uid, "its head is damaged" if fields is None else "its head does not match its digest"
                )
            needed = range(head.chunks) if fields is None else self._needed(fields, shares, response)
            return SplitPayload(
                head.prefix,
                [
                    Window(Frame(self, index), 0, head.length(index)) if index in needed else _zeros(head.length(index))
                    for index in range(head.chunks)
                ],
            )
        if fields is None:
            found = self._plain(range(head.chunks))
            payload = SplitPayload(head.prefix, [b"" if (got := found[i]) is None else got for i in range(head.chunks)])
            problem = digests.mismatch(payload, self.size, self.digest) if head.intact else "its head is damaged"
            if problem is not None:
                raise DamagedPayload(self.uid, problem)
            return payload
        if not head.intact:
            raise DamagedPayload(self.uid, "its head does not match its digest")
        needed = self._needed(fields, shares, response)
        found = self._plain(sorted(needed))
        pieces: list[Run] = []
        for index in range(head.chunks):
            length = head.length(index)
            if index not in needed:
                pieces.append(_zeros(length))
                continue
            got = found[index]
            if got is None or len(got) != length or digests.of(got) != head.digests[index]:
                raise DamagedPayload(self.uid, f"chunk {index} of its data does not match its digest")
            pieces.append(got)
        return SplitPayload(head.prefix, pieces)

    def _needed(self, fields: Collection[str], shares: Shares | None, response: int) -> set[int]:
        """The chunks a reply of `fields` reads (of the rows of `shares` only, where given): those
        they lie in, and the action mask's for advantages spread under it."""
        head = self._head
        _, header, _, _ = parts_of(SplitPayload(head.prefix, []))
        entries = stored_entries(header, head.section_len)
        wanted = {json_text(name) for name in fields}
        mask = {json_text("action_mask")} if _READS_MASK & set(fields) else set()
        whole = wanted | mask if shares is None else mask  # the mask whole: advantages spread under it, then cut
        spans = [(start, end) for name, _, _, start, end in entries if name in whole]
        if shares is not None:
            spans += shares.spans(entries, wanted - mask, response)
        return {index for start, end in spans for index in head.span(start, end)}

    def detach(self) -> Deferred:
        """The same payload with its head and chunks copied out of the snapshot (still to be checked)."""
        if self._copied is None:
            found = [self._stored(index) for index in range(self._head.chunks)]
            self._copied = [None if chunk is None else bytes(chunk) for chunk in found]
            self._head = dataclasses.replace(self._head, prefix=memoryview(bytes(self._head.prefix)))
        return self


class Frame:
    """Chunk `index` of a Deferred whose table keeps it as a zstd frame (pieces.Lazy): decompressed,
    and checked against its digest, when a reply reads it, and kept among the few chunks
    decompressed last (RECENT) until a read reaches its end: the parts of a reply are cut in
    order, and the next part cut inside the chunk finds it there."""

    __slots__ = ("_deferred", "_index")

    def __init__(self, deferred: Deferred, index: int) -> None:
        self._deferred, self._index = deferred, index

    def __len__(self) -> int:
        return self._deferred.head.length(self._index)

    def read(self, start: int, end: int) -> bytes | memoryview:
        plain = RECENT.get(self)
        if plain is None:
            plain = self._deferred.checked_chunk(self._index)
        if end >= len(self):
            RECENT.drop(self)
        else:
            RECENT.keep(self, plain)
        return memoryview(plain)[start:end]

    def detach(self) -> Frame:
        self._deferred.detach()
        return self


class Recent:
    """The chunks decompressed last, `most` of them whichever reply read them: a reply holds a
    chunk or two of its zstd frames decompressed at a time, not its batch (a mask read for the
    advantages spread under it, then the parts, would otherwise keep a chunk of each experience)."""

    def __init__(self, most: int) -> None:
        self._most, self._lock = most, threading.Lock()
        self._held: collections.OrderedDict[Frame, Bytes] = collections.OrderedDict()

    def get(self, frame: Frame) -> Bytes | None:
        with self._lock:
            return self._held.get(frame)

    def keep(self, frame: Frame, plain: Bytes) -> None:
        with self._lock:
            self._held[frame] = plain
            self._held.move_to_end(frame)
            while len(self._held) > self._most:
                self._held.popitem(last=False)

    def drop(self, frame: Frame) -> None:
        with self._lock:
            self._held.pop(frame, None)


RECENT = Recent(4)


def _zeros(length: int) -> Bytes:
    """Stands for a chunk a reply does not read: never read."""
    return _ZEROS[:length] if length <= len(_ZEROS) else bytes(length)


def checked(
    blobs: Sequence[Stored | Deferred],
    fields: Collection[str] | None = None,
    shares: Shares | None = None,
    responses: Sequence[int] = (),
) -> list[Stored]:
    """Payloads, those a take deferred read and checked now, all of them or, given the fields of
    a reply (and the shares of its tokens, item i's response being `responses[i]` tokens long),
    what those need (Deferred.resolve): a damaged one raises DamagedPayload naming it."""
    return [
        blob.resolve(fields, shares, responses[at] if shares is not None else 0) if isinstance(blob, Deferred) else blob
        for at, blob in enumerate(blobs)
    ]


def token_length(blob: Stored | Deferred | None) -> int | None:
    """How many tokens a stored experience has, from its safetensors header alone: a deferred
    one's head, or a stored value (a head, for one stored in chunks, a reference to a shared
    prompt, or the payload). None
    without tokens, or where the header cannot be read (damage, which its read check finds)."""
    try:
        if blob is None:
            return None
        if isinstance(blob, Deferred):
            head: Head | None = blob.head
        elif not isinstance(blob, SplitPayload) and len(blob) >= _FRAME.size and is_head(blob):
            head = read_head(blob)
        else:
            head = None
        if head is not None:
            _, header, _, _ = parts_of(SplitPayload(head.prefix, []))
            length = head.section_len
        else:
            assert not isinstance(blob, Deferred)
            if not isinstance(blob, SplitPayload) and len(blob) >= 4 and shared_prompts.is_ref(blob):
                header, length = shared_prompts.header_of(blob)
            else:
                _, header, _, length = parts_of(blob)
        return token_count(stored_entries(header, length))
    except (ValueError, struct.error):
        return None


def taken(uid: str, value: Bytes, key: bytes, digest: bytes, size: int, read: Read) -> Stored | Deferred:
    """A stored value as a taken batch holds it: a head whose frame reads as a Deferred, its
    chunks read later with `read`; anything else as `resolve` reads it, now."""
    if len(value) >= _FRAME.size and is_head(value):
        try:
            head = read_head(value)
        except (ValueError, struct.error):
            pass  # damaged: the read check, now, finds it does not match
        else:
            return Deferred(uid, head, key, digest, size, read)
    return resolve(value, key, read)


def read_payload(
    txn: lmdb.Transaction[bytes] | lmdb.Transaction[memoryview], dbs: dict[str, lmdb._Database], key: bytes
) -> Stored | None:
    """The payload stored under `key` (resolve), read in `txn`; None if there is none."""
    value = txn.get(key, db=dbs["blobs"])
    if value is None:
        return None
    return resolve(value, key, reader(txn, dbs))


def reader(
    source: lmdb.Transaction[bytes] | lmdb.Transaction[memoryview] | Snapshot, dbs: dict[str, lmdb._Database]
) -> Read:
    """`resolve`'s reads of the out-of-line pieces of payloads, from a transaction or a snapshot."""
    return lambda name, key: source.get(key, db=dbs[name])


def _any_chunk(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bool:
    """Whether a table holds any chunk (of a stored experience, or staged)."""
    with txn.cursor(db=dbs["chunks"]) as cur:
        return bool(cur.set_range(prefix)) and bytes(cur.key()[:4]) == prefix


def delete(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    keys: Iterable[bytes],
    sizes: Sequence[int] | None = None,
) -> None:
    """Delete stored payloads (absent ones are no error), the chunk sets of those stored in chunks
    (the one an intact head names; a damaged one's, the set marked with its key) and their
    references to shared prompts: with their sizes (the records'), only one that may be either is
    looked at (larger than CHUNK_BYTES; larger than MIN_COMPRESSED, in a table that holds any
    chunk; or of at least shared_prompts.MIN_BYTES, in a table that keeps shared prompts), so that
    a consume of small experiences reads none, and one of experiences of up to 4 MiB in a table
    that holds no chunk none either."""
    blobs = dbs["blobs"]
    chunking: dict[bytes, bool] = {}  # by table prefix: whether the table holds any chunk
    sharing: dict[bytes, bool] = {}  # ... and any shared prompt
    for at, key in enumerate(keys):
        prefix = bytes(key[:4])
        look = sizes is None or sizes[at] > CHUNK_BYTES
        if not look and sizes is not None and sizes[at] > MIN_COMPRESSED:
            if prefix not in chunking:
                chunking[prefix] = _any_chunk(txn, dbs, prefix)
            look = chunking[prefix]
        if not look and sizes is not None and sizes[at] >= shared_prompts.MIN_BYTES:
            if prefix not in sharing:
                sharing[prefix] = shared_prompts.any_in(txn, dbs, prefix)
            look = sharing[prefix]
        if look:
            value = txn.get(key, db=blobs)
            if value is not None and len(value) >= 4 and shared_prompts.is_ref(value):
                shared_prompts.release(txn, dbs, key, value)
            elif value is not None and (head := _intact_head(value)) is not None and _marked(txn, dbs, key, head):
                drop_set(txn, dbs, prefix, head.set_id)
            elif value is not None and (is_head(value) or sizes is None or len(value) != sizes[at]):
                # A damaged head (or one whose magic is damaged: not as long as its record says)
                # may name another experience's set: its own is the one marked with its key (the
                # chunks' bytes cannot say: two experiences may hold the same).
                for set_id in _sets_of(txn, dbs, key):
                    drop_set(txn, dbs, prefix, set_id)
        txn.delete(key, db=blobs)
