"""The rows of a table's rollouts held in pieces (rules/partials.py says what they are), in the
`partials` database: T + uid + NUL -> the rollout's head (`PieceHead`, JSON: the tokens and response
tokens held, each piece's offset and digest, the tensors later pieces append to, what its version
segments say so far), and T + uid + NUL + piece number (u32) -> the piece as the store packs an
experience. Functions over a transaction and the store's databases: the writer's (core/verbs/pieces.py
keeps a table's counters beside them) and the read transactions that put a large rollout
together off the writer (services/assembly.py).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import lmdb

from expbuf.client.trxp.codec import partial

from ..schema.errors import DamagedPiece
from . import digests

_PIECE = struct.Struct(">I")
LOST = "it is not stored"  # why a piece its head names and the database does not hold is damage
UNDECODED = "its head does not decode"  # why a rollout whose head a damaged page left so is damage
Value = bytes | memoryview


@dataclass
class PieceHead:
    """What the store keeps of a rollout held in pieces, beside them."""

    tokens: int  # the rollout's tokens held (the prompt's among them)
    response: int  # ... of them after the prompt
    pieces: list[tuple[int, str, int]]  # each piece's offset, digest (hex) and size, in order
    layout: partial.Layout
    versions: partial.Versions

    def encode(self) -> bytes:
        versions = [self.versions.carried, self.versions.last]
        return json.dumps(
            {"t": self.tokens, "r": self.response, "p": self.pieces, "l": self.layout, "v": versions},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> PieceHead:
        """A head as stored; ValueError, or the decoder's error, where it is not one a push wrote."""
        data = json.loads(bytes(raw))
        layout = {name: (dtype, tuple(inner)) for name, (dtype, inner) in data["l"].items()}
        pieces = [(offset, digest, size) for offset, digest, size in data["p"]]
        numbers = [data["t"], data["r"], *(n for offset, _, size in pieces for n in (offset, size))]
        if not all(type(n) is int for n in numbers) or not all(len(bytes.fromhex(d)) == 16 for _, d, _ in pieces):
            raise ValueError("a count, an offset, a size or a digest is not one a push wrote")
        return cls(data["t"], data["r"], pieces, layout, partial.Versions(*data["v"]))


def size(head: PieceHead) -> int:
    """The bytes of a rollout's pieces."""
    return sum(size for _, _, size in head.pieces)


def head_key(prefix: bytes, uid: str) -> bytes:
    """The key of a rollout's head in the partials database, under its table's prefix."""
    return prefix + uid.encode() + b"\0"


def head_raw(txn: lmdb.Transaction[Value], dbs: Mapping[str, lmdb._Database], key: bytes) -> Value | None:
    """The stored head under `key`, as stored (None: no rollout)."""
    return txn.get(key, db=dbs["partials"])


def head(txn: lmdb.Transaction[Value], dbs: Mapping[str, lmdb._Database], key: bytes, uid: str) -> PieceHead | None:
    """The head of the rollout `uid` under `key`, decoded (None: no rollout); DamagedPiece where it
    does not decode."""
    raw = head_raw(txn, dbs, key)
    return None if raw is None else decoded(raw, uid)


def decoded(raw: Value, uid: str) -> PieceHead:
    """The rollout `uid`'s head as stored, decoded: DamagedPiece where a damaged page left it
    undecodable, so that the rollout is refused and dropped as one with a damaged piece is."""
    try:
        return PieceHead.decode(raw)
    except Exception as exc:  # a damaged page can make the decoder raise almost anything
        raise DamagedPiece(uid, None, f"{UNDECODED} ({type(exc).__name__}: {exc})") from None


def piece(txn: lmdb.Transaction[Value], dbs: Mapping[str, lmdb._Database], key: bytes, number: int) -> Value | None:
    """Piece `number` of the rollout whose head is under `key` (None: not stored)."""
    return txn.get(key + _PIECE.pack(number), db=dbs["partials"])


def checked(
    txn: lmdb.Transaction[Value], dbs: Mapping[str, lmdb._Database], key: bytes, uid: str, head: PieceHead, number: int
) -> Value:
    """Piece `number` of the rollout `uid` whose head is under `key`, checked against the size and
    digest its head took at its push: DamagedPiece where it is lost or not the one pushed."""
    raw = piece(txn, dbs, key, number)
    if raw is None:
        raise DamagedPiece(uid, number, LOST)
    why = problem(head, number, raw)
    if why is not None:
        raise DamagedPiece(uid, number, why)
    return raw


def problem(head: PieceHead, number: int, raw: Value) -> str | None:
    """Why piece `number` as stored is not the one its rollout's head took at its push (its size
    and digest), or None."""
    _, digest, size = head.pieces[number]
    return digests.mismatch(raw, size, bytes.fromhex(digest))


def put_piece(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], key: bytes, number: int, blob: bytes
) -> None:
    """Piece `number` of the rollout whose head is under `key`."""
    txn.put(key + _PIECE.pack(number), blob, db=dbs["partials"])


def put_head(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], key: bytes, head: PieceHead) -> None:
    txn.put(key, head.encode(), db=dbs["partials"])


def delete(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], key: bytes, head: PieceHead) -> None:
    """A rollout's pieces and head (the pieces' values are not read: a large rollout's pages stay
    out of the writer's memory)."""
    for number in range(len(head.pieces)):
        txn.delete(key + _PIECE.pack(number), db=dbs["partials"])
    txn.delete(key, db=dbs["partials"])


def delete_under(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], key: bytes) -> int:
    """A rollout's head and every piece stored under it, where its head no longer decodes to name
    them; returns the bytes of the pieces."""
    freed = 0
    with txn.cursor(db=dbs["partials"]) as cur:
        found = cur.set_range(key)
        while found and cur.key().startswith(key):
            freed += len(cur.value()) if len(cur.key()) > len(key) else 0
            found = cur.delete()
    return freed


def heads_under(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], start: bytes, prefix: bytes
) -> list[tuple[str, bytes]]:
    """The rollouts whose keys start with `start` (a table's `prefix` and the start of their uids):
    each one's uid and stored head."""
    rows = []
    with txn.cursor(db=dbs["partials"]) as cur:
        found = cur.set_range(start)
        while found and bytes(cur.key()).startswith(start):
            uid = _head_of(bytes(cur.key()), prefix)
            if uid is not None:
                rows.append((uid, bytes(cur.value())))
            found = cur.next()
    return rows


def rows(
    txn: lmdb.Transaction[Value], dbs: Mapping[str, lmdb._Database], prefix: bytes
) -> Iterator[tuple[str | None, int | None, Value]]:
    """Every row of a table's rollouts held in pieces, in key order, so each rollout's head comes
    before its pieces: the rollout's uid (None: a key that is neither a head's nor a piece's), the
    piece's number (None: the head) and the value, read only until the next row is."""
    with txn.cursor(db=dbs["partials"]) as cur:
        found = cur.set_range(prefix)
        while found and bytes(cur.key()).startswith(prefix):
            rest = bytes(cur.key())[len(prefix) :]
            end = rest.find(b"\0")
            tail = len(rest) - end - 1
            try:
                uid = rest[:end].decode() if end >= 0 and tail in (0, _PIECE.size) else None
            except UnicodeDecodeError:
                uid = None
            number = _PIECE.unpack(rest[end + 1 :])[0] if uid is not None and tail else None
            yield uid, number, cur.value()
            found = cur.next()


def _head_of(key: bytes, prefix: bytes) -> str | None:
    """The uid of a rollout's head key (T + uid + NUL); None for a piece's (a uid holds no NUL), and
    for a key a damaged page left neither."""
    end = key.find(b"\0", len(prefix))
    try:
        return key[len(prefix) : end].decode() if end == len(key) - 1 else None
    except UnicodeDecodeError:
        return None
