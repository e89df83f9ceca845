"""Payloads stored in chunks (chunked.py) read back: whole (`resolve`), as a digest taken a
chunk at a time (`streamed`), or deferred to where a batch's reply is built (`taken`,
`Deferred`), which reads only the chunks the reply's fields lie in.

Read back, a head and its chunks are a `pieces.SplitPayload`, the same bytes as the one-item
payload stored whole would be, which the record's digest is taken over (digests.of): a retried
push is a duplicate however its experience was stored.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import struct
import threading
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, cast, final

import lmdb

from expbuf.client.trxp.codec.build import json_text
from expbuf.client.trxp.stored.columns import Shares, token_count
from expbuf.client.trxp.stored.pieces import Bytes, Run, SplitPayload, Stored, Window, parts_of
from expbuf.client.trxp.stored.splice import stored_entries

from ..schema.errors import DamagedPayload
from . import digests, shared_prompts
from .chunk_heads import (
    CHUNK_BYTES,
    FRAME,
    HEAD_MAGIC,
    ZSTD_MAGIC,
    ChunkHead,
    chunk_key,
    intact_head,
    is_head,
    read_head,
)
from .shared_prompts import Read
from .zstd_workers import DECOMPRESSING

if TYPE_CHECKING:
    from .snapshot import Snapshot


# The first bytes of a stored value that is not the payload itself: a head of chunks, a reference.
_NOT_WHOLE = (HEAD_MAGIC, ZSTD_MAGIC, shared_prompts.REF_MAGIC)
# Their fourth bytes, which differ from a payload's (TRXP): a value whose fourth byte is none of
# these is whole without its first four compared (a view's slice compared with bytes costs a take
# about 2,000 instructions an experience).
_NOT_WHOLE_FOURTH = frozenset(magic[3] for magic in _NOT_WHOLE)
_FOURTH = operator.itemgetter(3)


def whole(value: Bytes) -> bool:
    """Whether a stored value is the payload itself, stored whole (most are): neither a head of
    chunks nor a reference to a shared prompt, it is what `resolve` and `taken` read it as."""
    return len(value) < 4 or value[3] not in _NOT_WHOLE_FOURTH or bytes(value[:4]) not in _NOT_WHOLE


def all_whole(values: Iterable[Bytes | None]) -> list[bool]:
    """`whole` of each of a batch's stored values (False where none is stored), its rule written
    inline: a take asks it of every experience."""
    fourth, magics = _NOT_WHOLE_FOURTH, _NOT_WHOLE
    return [
        value is not None and (len(value) < 4 or value[3] not in fourth or bytes(value[:4]) not in magics)
        for value in values
    ]


def each_whole(values: Sequence[Bytes | None]) -> bool:
    """Whether every one of a batch's stored values is surely a payload stored whole (`whole`), found
    a list at a time, no Python step a value: none missing, none shorter than a magic (the fourth
    byte of either raises), no fourth byte one of theirs. False: one may not be, which `all_whole`
    says."""
    try:
        return _NOT_WHOLE_FOURTH.isdisjoint(map(_FOURTH, cast("Sequence[Bytes]", values)))
    except (TypeError, IndexError):  # one not stored, or shorter than four bytes
        return False


def resolve(value: Bytes, key: bytes | memoryview, read: Read) -> Stored:
    """A stored value as the payload it stands for: itself, a reference's payload with its shared
    prompt (shared_prompts.py), or a head's prefix and its chunks, read with `read` (a
    database's name and a key to the value). A chunk that is missing reads as nothing and a
    head whose frame, or whose own digest, is damaged as its bytes, which the read check then
    finds do not match."""
    if len(value) >= 4 and shared_prompts.is_ref(value):
        return shared_prompts.resolve(value, key, read)
    head = intact_head(value)
    if head is None:
        return value
    plain = head.plain_each(range(head.chunks), stored_chunks(head, key, read))
    return SplitPayload(head.prefix, [b"" if chunk is None else chunk for chunk in plain])


def stored_chunks(head: ChunkHead, key: bytes | memoryview, read: Read) -> list[Bytes | None]:
    """A head's chunks as stored (None where one is missing)."""
    prefix = bytes(key[:4])
    return [read("chunks", chunk_key(prefix, head.set_id, index)) for index in range(head.chunks)]


def streamed(value: Bytes, key: bytes | memoryview, read: Read) -> tuple[bytes, int] | None:
    """The digest and length of the payload an intact head of zstd frames stands for, its chunks
    decompressed one at a time, so that a check of it (the scrub's) holds one chunk, not the
    payload: a chunk missing or that does not decompress adds nothing. None for any other value
    (read it whole with `resolve`)."""
    head = intact_head(value)
    if head is None or not head.compressed:
        return None
    whole, size = digests.running(), len(head.prefix)
    whole.update(head.prefix)
    for index, stored in enumerate(stored_chunks(head, key, read)):  # decompressed one at a time
        chunk = head.plain(index, stored)
        if chunk is not None:
            whole.update(chunk)
            size += len(chunk)
    return whole.digest(), size


# What a reply of these fields reads besides them: the action mask, which advantages of one value
# an experience are spread under (stored_advantages.expand).
_READS_MASK = frozenset({"advantages", "returns"})
_ZEROS = memoryview(bytes(CHUNK_BYTES))  # stands for a chunk a reply does not read: never read


@final
class Deferred:
    """A payload stored in chunks, taken by its head alone in the writer's transaction: its chunks
    are read from the snapshot the batch was taken in, and checked, where the batch's reply is
    built (`resolve`), off the writer, so that a take of long rollouts never holds the writer
    while their bytes are read from disk and digested. A reply of some fields reads only the
    chunks they lie in. Should the snapshot have to end first (a map resize), `detach` copies the
    head and the chunks out of it."""

    __slots__ = ("_chunk", "_copied", "_head", "_key", "digest", "size", "uid")

    def __init__(self, uid: str, head: ChunkHead, key: bytes, digest: bytes, size: int, read: Read) -> None:
        self.uid, self._head, self._key, self.digest, self.size = uid, head, key, digest, size
        self._chunk = partial(read, "chunks")
        self._copied: list[Bytes | None] | None = None  # the chunks, once detached

    @property
    def head(self) -> ChunkHead:
        """Its head as stored: what it holds, before its chunks are read."""
        return self._head

    def _stored(self, index: int) -> Bytes | None:
        if self._copied is not None:
            return self._copied[index]
        return self._chunk(chunk_key(bytes(self._key[:4]), self._head.set_id, index))

    def _plain(self, indices: Sequence[int]) -> dict[int, Bytes | None]:
        """Chunks' bytes as pushed (ChunkHead.plain_each), by their numbers."""
        stored = [self._stored(index) for index in indices]
        return dict(zip(indices, self._head.plain_each(indices, stored, DECOMPRESSING), strict=True))

    def checked_chunk(self, index: int) -> Bytes:
        """Chunk `index`'s bytes as pushed, checked against its digest (DamagedPayload if not)."""
        return self.checked_from(index, self._stored(index))

    def ahead(self, index: int) -> Future[Bytes]:
        """`checked_chunk(index)` on the decompressing threads: its stored frame read here (a
        snapshot is read on one thread at a time) and copied, so that the work needs nothing of the
        snapshot, which may end before it does."""
        stored = self._stored(index)
        return DECOMPRESSING.submit(self.checked_from, index, None if stored is None else bytes(stored))

    def checked_from(self, index: int, stored: Bytes | None) -> Bytes:
        """Chunk `index`'s bytes as pushed from its stored value, checked against its digest."""
        got = self._head.plain(index, stored)
        if got is None or len(got) != self._head.length(index) or digests.of(got) != self._head.digests[index]:
            raise DamagedPayload(self.uid, f"chunk {index} of its data does not match its digest")
        return got

    def resolve(
        self,
        fields: Collection[str] | None = None,
        shares: Shares | None = None,
        response: int = 0,
        ahead: Ahead | None = None,
    ) -> SplitPayload:
        """The payload, checked: all of it against its record's digest; or, given the fields a
        reply reads, its head against the head's own digest and the chunks those fields lie in
        against theirs, the others standing as zeros no reply reads. With `shares` (the
        experience's response being `response` tokens), only the chunks of the rows in them.
        DamagedPayload if what is read is not what was pushed. A head of zstd frames whose own
        digest matches gives its chunks as Windows of Frames: each decompressed, and checked
        against its digest in the head, as the part of a reply that holds it is cut (the head's
        digest names theirs: what they check together is the payload pushed), so that a reply
        holds a chunk or two of them at a time, not the batch's; with its reply's `ahead`, each
        read ahead of its turn (Frame)."""
        head = self._head
        if head.compressed:
            if not head.intact:
                raise DamagedPayload(
                    self.uid, "its head is damaged" if fields is None else "its head does not match its digest"
                )
            needed = range(head.chunks) if fields is None else self._needed(fields, shares, response)
            frames: dict[int, Frame] = {}
            following = None
            for index in sorted(needed, reverse=True):  # each names the next one read, to decompress it ahead
                following = frames[index] = Frame(self, index, following, ahead)
            return SplitPayload(
                head.prefix,
                [
                    Window(frames[index], 0, head.length(index)) if index in frames else _zeros(head.length(index))
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
    decompressed last (RECENT): the next part cut inside the chunk, or the next field read from
    it, finds it there (a reply reads fields in the order asked, not the order stored, so a read
    that reaches a chunk's end need not be its last: one let go there was decompressed again for
    the next field, twice a chunk for a payload of one). With its reply's `Ahead`, the
    first read of a chunk starts the next chunk of the same payload the reply reads (`following`)
    on the decompressing threads, so that it is decompressed while this one's parts are sent: the
    reply's Ahead holds it, one such chunk on its way at a time."""

    __slots__ = ("_deferred", "_index", "_reads", "following", "seen")

    def __init__(
        self, deferred: Deferred, index: int, following: Frame | None = None, reads: Ahead | None = None
    ) -> None:
        self._deferred, self._index, self.following, self._reads = deferred, index, following, reads
        self.seen = False  # read once: a read ahead of it would be of a chunk read already

    def __len__(self) -> int:
        return self._deferred.head.length(self._index)

    def read(self, start: int, end: int) -> bytes | memoryview:
        plain = RECENT.get(self)
        if plain is None:
            self.seen = True
            ahead = None
            if self._reads is not None:
                ahead = self._reads.taken(self)
                if self.following is not None:
                    self._reads.start(self.following)
            plain = self._deferred.checked_chunk(self._index) if ahead is None else ahead.result()
        RECENT.keep(self, plain)
        return memoryview(plain)[start:end]

    def ahead(self) -> Future[Bytes]:
        """This chunk, decompressed and checked on the decompressing threads (Deferred.ahead)."""
        return self._deferred.ahead(self._index)

    def detach(self) -> Frame:
        self._deferred.detach()
        return self


class Ahead:
    """A reply's read ahead (Frame): one chunk on its way at a time, made (by `checked`) for a
    reply whose reads go from a payload's chunk to the next: a payload whole (TRXP, a Get) or the
    fields of one payload. One that reads a field of every experience before the next field has
    none: each experience's next chunk would wait a whole pass, or be read already."""

    __slots__ = ("_frame", "_future")

    def __init__(self) -> None:
        self._frame: Frame | None = None  # the frame whose chunk is on its way, and its future
        self._future: Future[Bytes] | None = None

    def start(self, frame: Frame) -> None:
        """`frame`'s chunk on its way, unless another is or the reply has read it already."""
        if self._frame is None and not frame.seen:
            self._frame, self._future = frame, frame.ahead()

    def taken(self, frame: Frame) -> Future[Bytes] | None:
        """`frame`'s chunk if it is the one on its way, which it then no longer is."""
        if self._frame is not frame:
            return None
        future, self._frame, self._future = self._future, None, None
        return future


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
    what those need (Deferred.resolve): a damaged one raises DamagedPayload naming it. Their zstd
    frames are read ahead as one reply's, where its reads go in order (Ahead)."""
    # `type(blob) is`: isinstance of a blob that is not one looks up its __class__, some 500 instructions
    deferred = sum([type(blob) is Deferred for blob in blobs])
    ahead = Ahead() if fields is None or deferred == 1 else None
    return [
        blob.resolve(fields, shares, responses[at] if shares is not None else 0, ahead)
        if type(blob) is Deferred
        else blob
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
            head: ChunkHead | None = blob.head
        elif not isinstance(blob, SplitPayload) and len(blob) >= FRAME.size and is_head(blob):
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
    if len(value) >= FRAME.size and is_head(value):
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
