"""Tensor sections stored out of line, in chunks: no push, read or commit holds a large
experience whole. Here they are stored and deleted, and the heads of formats 6 to 8 resealed
(`reseal_heads`); a head's frame is chunk_heads.py's, the zstd threads zstd_workers.py's, and
their reads chunk_reads.py's.

An experience whose tensor section is larger than CHUNK_BYTES keeps in `blobs` a head, and
its section in `chunks`, CHUNK_BYTES a value (the last one shorter): chunk_heads.py. A table
that compresses (its setting `compression`) keeps so every section larger than MIN_COMPRESSED,
each chunk a zstd frame of its bytes, compressed before the writer takes it, its head's magic
b"TRXZ"; the digests stay those of the bytes as pushed, checked once decompressed.

A push in chunks stages its experiences' sections as they arrive (rpc/push/ingest.py): each chunk
is written under a set marked in `staged` (`stage`), in the writer's commits; the push's commit
writes the heads and unmarks their sets (`stored_value`), a push that fails drops them
(`drop_set`), and an open drops the sets that a stopped server left staged (`sweep_staged`). A
set number is never used twice (the next is kept in `meta`, `reserve_sets`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

import lmdb

from expbuf.client.trxp.stored.pieces import Bytes, section_at

from ..schema.errors import NotFound, clip
from . import chunk_heads, digests, shared_prompts
from .chunk_heads import (
    DIGESTED,
    OWNER,
    SET_NUMBER,
    chunk_key,
    format_8,
    intact_head,
    is_head,
    own_digest,
    pack_head,
    read_head,
    set_prefix,
)
from .chunk_reads import reader, stored_chunks
from .layout import delete_rows, micros
from .records import ItemRecord
from .zstd_workers import COMPRESSING, compress

# A table that compresses keeps in chunks, as frames, a section larger than this (one of up to
# CHUNK_BYTES in one chunk): rollouts of a few thousand tokens with MoE routing ids are 1-4 MiB.
MIN_COMPRESSED = 256 << 10
_NEXT_SET = b"next_chunk_set"  # in meta: the number the next chunk set takes


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


def _chunks_match(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, value: Bytes) -> bool:
    """Whether the chunks of the set a head names are those its digests name, one read at a time."""
    head = read_head(value)
    for index, stored in enumerate(stored_chunks(head, key, reader(txn, dbs))):
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
            found = None if value is None else format_8(value)
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
            txn.put(key, b"".join([view[:12], own_digest(view), view[DIGESTED:]]), db=dbs["blobs"])
            resealed += 1
        own(txn, dbs, key, set_id)
    return resealed


def _present(txn: lmdb.Transaction[bytes], db: lmdb._Database, key: bytes) -> bytes:
    """A value known to be stored."""
    value = txn.get(key, db=db)
    assert value is not None, "a value read in this very transaction"
    return value


def reserve_sets(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], count: int = 1) -> int:
    """The first of `count` chunk set numbers no one has used, from now on used."""
    raw = txn.get(_NEXT_SET, db=dbs["meta"])
    set_id = 1 if raw is None else SET_NUMBER.unpack(raw)[0]
    txn.put(_NEXT_SET, SET_NUMBER.pack(set_id + count), db=dbs["meta"])
    return set_id


def kept_whole(blobs: Sequence[bytes], prompt_bytes: Iterable[int]) -> bool:
    """Whether `stored_value` keeps each of these pushed payloads (of `prompt_bytes` of prompt tokens
    each) as it is: none a head, none over CHUNK_BYTES, none with a prompt long enough to share. Each
    is looked at in C, so a push of small experiences stores its payloads without a step each."""
    return (
        max(map(len, blobs), default=0) <= chunk_heads.CHUNK_BYTES
        and max(prompt_bytes, default=0) < shared_prompts.MIN_BYTES
        and not chunk_heads.any_head(blobs)
    )


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
    start = section_at(view) if len(blob) > chunk_heads.CHUNK_BYTES else len(blob)  # a small one's section is not read
    if len(view) - start <= chunk_heads.CHUNK_BYTES:  # kept in one value
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


def _marked(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes, set_id: int) -> bool:
    """Whether the set a head names (`set_id`) is marked as the data of the experience under `key`."""
    mark = txn.get(chunk_key(bytes(key[:4]), set_id, OWNER), db=dbs["chunks"])
    return mark is not None and bytes(mark) == bytes(key)


def _sets_of(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], key: bytes) -> list[int]:
    """The chunk sets marked as the data of the experience under `key`: a walk over its table's
    sets, a seek or two each, for a head that cannot be trusted to name its own (damaged, rare)."""
    prefix, found = bytes(key[:4]), []
    with txn.cursor(db=dbs["chunks"]) as cur:
        present = cur.set_range(prefix)
        while present and bytes(cur.key()[:4]) == prefix:
            set_id = SET_NUMBER.unpack(cur.key()[4:12])[0]
            if cur.set_key(chunk_key(prefix, set_id, OWNER)) and bytes(cur.value()) == bytes(key):
                found.append(set_id)
            present = cur.set_range(set_prefix(prefix, set_id + 1))
    return found


def cut(section: memoryview) -> list[Bytes]:
    """A section's chunks: CHUNK_BYTES each, the last one shorter."""
    return [section[at : at + chunk_heads.CHUNK_BYTES] for at in range(0, len(section), chunk_heads.CHUNK_BYTES)]


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
        drop_set(txn, dbs, bytes(key[:4]), SET_NUMBER.unpack(key[4:12])[0])
    return len(keys)


def staged_sets(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> int:
    return int(txn.stat(dbs["staged"])["entries"])


def _any_chunk(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bool:
    """Whether a table holds any chunk (of a stored experience, or staged)."""
    with txn.cursor(db=dbs["chunks"]) as cur:
        return bool(cur.set_range(prefix)) and bytes(cur.key()[:4]) == prefix


# A nested write transaction of `parent`'s whose reads are views of the map, not copies
# (Environment.views): for reads of a few bytes of large values, aborted once they are read.
Views = Callable[["lmdb.Transaction[bytes]"], "lmdb.Transaction[memoryview]"]
# What `delete` finds a payload it looks at to be (`_found`): a reference to a shared prompt, an
# intact head, one that may have a chunk set its head does not name (_set_unnamed), or none of these.
_REF, _HEAD, _UNNAMED, _PLAIN = range(4)


def delete(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    keys: Iterable[bytes],
    sizes: Sequence[int] | None = None,
    views: Views | None = None,
) -> None:
    """Delete stored payloads (absent ones are no error), the chunk sets of those stored in chunks
    (the one an intact head names; a damaged one's, the set marked with its key, and so a lost
    one's, whose chunks the directory kept) and their references to shared prompts: with their
    sizes (the records'), only one that may be either is looked at (larger than CHUNK_BYTES;
    larger than MIN_COMPRESSED, in a table that holds any chunk; or of at least
    shared_prompts.MIN_BYTES, in a table that keeps shared prompts), so that a consume of small
    experiences reads none, and one of experiences of up to 4 MiB in a table that holds no chunk
    none either. They go in key order, through one cursor, in whatever order they are given.
    With `views`, a payload looked at is read in place, not copied: of a reference to a shared
    prompt (every 40 KB experience of a table that keeps them) only its first 36 bytes are read."""
    keys = list(keys)
    blobs, ordered = dbs["blobs"], sorted(keys)
    looked = range(len(keys)) if sizes is None else _looked(txn, dbs, keys, sizes, _tables(ordered))
    if looked:
        looked_keys = [keys[at] for at in looked]
        looked_sizes = [None if sizes is None else sizes[at] for at in looked]
        found = _read(txn, blobs, looked_keys, looked_sizes, views)
        for key, (kind, frame, set_id) in zip(looked_keys, found, strict=True):
            if kind == _REF:
                shared_prompts.release(txn, dbs, key, frame)
            elif kind == _HEAD and _marked(txn, dbs, key, set_id):
                drop_set(txn, dbs, bytes(key[:4]), set_id)
            elif kind != _PLAIN:  # a head whose set is not marked as its own is one whose set it may not name
                for set_id in _sets_of(txn, dbs, key):
                    drop_set(txn, dbs, bytes(key[:4]), set_id)
    delete_rows(txn, blobs, ordered)


def _read(
    txn: lmdb.Transaction[bytes],
    blobs: lmdb._Database,
    keys: Sequence[bytes],
    sizes: Sequence[int | None],
    views: Views | None,
) -> list[tuple[int, bytes, int]]:
    """What each payload `delete` looks at is (`_found`), read in a nested transaction of views
    (`views`, aborted once they are read: nothing is written in it) or else copied."""
    if views is None:
        return [_found(txn.get(key, db=blobs), size) for key, size in zip(keys, sizes, strict=True)]
    child = views(txn)
    try:
        return [_found(child.get(key, db=blobs), size) for key, size in zip(keys, sizes, strict=True)]
    finally:
        child.abort()


def _found(value: Bytes | None, size: int | None) -> tuple[int, bytes, int]:
    """What a payload being deleted is (its stored `value`, None: not stored; `size`, its
    record's), with what `delete` then needs of it, outliving the value: a reference's frame
    (shared_prompts.release), an intact head's set number."""
    if value is not None and len(value) >= 4 and shared_prompts.is_ref(value):
        return _REF, shared_prompts.frame(value), 0
    head = None if value is None else intact_head(value)
    if head is not None:
        return _HEAD, b"", head.set_id
    return (_UNNAMED if _set_unnamed(value, size) else _PLAIN), b"", 0


def _tables(ordered: Sequence[bytes]) -> set[bytes]:
    """The table prefixes of keys in order: one where the first key and the last share it (mostly:
    every key between has it too), no look at each."""
    if not ordered:
        return set()
    first, last = bytes(ordered[0][:4]), bytes(ordered[-1][:4])
    return {first} if first == last else {bytes(key[:4]) for key in ordered}


def _looked(
    txn: lmdb.Transaction[bytes],
    dbs: dict[str, lmdb._Database],
    keys: Sequence[bytes],
    sizes: Sequence[int],
    tables: set[bytes],
) -> list[int]:
    """Which of the payloads being deleted (at `keys`, of `sizes`; of the tables of `tables`'
    prefixes) may be other than a payload stored whole, and must be read first (delete's rule): the
    index of each."""
    top = max(sizes, default=0)
    limits: dict[bytes, int] = {}  # by table prefix: the size a payload is looked at above
    for prefix in tables:
        limit = chunk_heads.CHUNK_BYTES
        if top > MIN_COMPRESSED and _any_chunk(txn, dbs, prefix):
            limit = MIN_COMPRESSED
        if top >= shared_prompts.MIN_BYTES and shared_prompts.any_in(txn, dbs, prefix):
            limit = min(limit, shared_prompts.MIN_BYTES - 1)
        limits[prefix] = limit
    if len(limits) == 1:  # one table's (mostly)
        (limit,) = limits.values()
        return [at for at, size in enumerate(sizes) if size > limit] if top > limit else []
    return [at for at, (key, size) in enumerate(zip(keys, sizes, strict=True)) if size > limits[bytes(key[:4])]]


def _set_unnamed(value: Bytes | None, size: int | None) -> bool:
    """Whether a payload being deleted (`value`, None: not stored; `size`, its record's) may have a
    chunk set its head does not name: a damaged head (or one whose magic is damaged: not as long
    as its record says) may name another experience's set, and a lost one (of a payload large
    enough to have been a head) names none. Its own is then the one marked with its key (the
    chunks' bytes cannot say: two experiences may hold the same)."""
    if value is None:
        return size is None or size > MIN_COMPRESSED
    return is_head(value) or size is None or len(value) != size


def chunk_sets(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], p: bytes) -> tuple[set[int], int]:
    """A table's (its prefix `p`) chunk sets that no head names, no push stages and no stored
    payload is marked as owning, and how many sets intact heads name that are not marked as theirs."""
    named: set[int] = set()
    staged: set[int] = set()
    found: set[int] = set()
    unmarked = 0
    with txn.cursor(db=dbs["blobs"]) as cur:
        present = cur.set_range(p)
        while present and cur.key().startswith(p):
            value = cur.value()
            if chunk_heads.is_head(value):
                with contextlib.suppress(Exception):  # a damaged head: the payload's own check says so
                    head = chunk_heads.read_head(value)
                    named.add(head.set_id)
                    mark = txn.get(chunk_heads.chunk_key(p, head.set_id, chunk_heads.OWNER), db=dbs["chunks"])
                    unmarked += head.intact and mark != cur.key()
            present = cur.next()
    for db, into in (("staged", staged), ("chunks", found)):
        with txn.cursor(db=dbs[db]) as cur:
            present = cur.set_range(p)
            while present and cur.key().startswith(p):
                into.add(int.from_bytes(cur.key()[4:12], "big"))
                present = cur.next()
    strays = set()
    for set_id in found - named - staged:
        owner = txn.get(chunk_heads.chunk_key(p, set_id, chunk_heads.OWNER), db=dbs["chunks"])
        if owner is None or txn.get(owner, db=dbs["blobs"]) is None:
            strays.add(set_id)
    return strays, unmarked
