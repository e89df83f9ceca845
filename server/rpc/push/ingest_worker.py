"""An ingest process (ingest.py's pool): it decodes each payload the server puts in their shared
region, writes the experiences' bytes back there and replies with their other fields, or the
refusal. Also the decode itself (`entries_of`), which the server runs the same way for the pushes it
keeps.

The server starts it as `python -m expbuf.server.rpc.push.ingest_worker CONN REGION MAX_METADATA`
(the file descriptors of its connection and region, which it inherits): a fresh interpreter that
imports only the codec and the store's entry, not the server. A process spawned by multiprocessing
would import the server's main module again (the command line and the service), some 0.5 s of CPU
at every server start and every replacement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import operator
import os
import pickle
import signal
import struct
import sys
from multiprocessing.connection import Connection
from typing import Any

from expbuf.client import trxp
from expbuf.client.trxp.column_batch import wire as column_wire

from ...store import Entry
from ...store.schema.errors import InvalidPayload

FIELDS = tuple(field.name for field in dataclasses.fields(Entry))
BLOB = FIELDS.index("blob")
fields_of = operator.attrgetter(*FIELDS)
REQUEST = struct.Struct("<QQ")  # payload length, region size
_MIN_REGION = 1 << 22
_KEEP = 64 << 20  # the memory a region keeps between pushes; a larger push's is given back after it
# The server's stop signals, which a worker leaves to the server. It is started with them blocked
# (the mask outlives exec), so one sent while its interpreter starts waits, and is discarded once
# the worker ignores it: there is no earlier moment at which a new process could ignore it.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def metadata_limit(max_bytes: int) -> trxp.MetadataLimit:
    """The limit of an experience's metadata, as a refusal names its setting."""
    return trxp.MetadataLimit(
        max_bytes,
        f"max_metadata_bytes = {max_bytes} (raise it with EXPBUF_MAX_METADATA_BYTES, or carry large data "
        "in tensors: multi-modal inputs)",
    )


def entries_of(payload: bytes | memoryview, limit: trxp.MetadataLimit | None = None) -> list[Entry]:
    """A pushed payload's experiences, validated and packed as the store keeps them; a payload
    the codec refuses is an InvalidPayload, with the codec's message.

    An experience's metadata is unpickled (or, for a batch of columns, made from them), then
    pickled in its canonical form: for a moment both are held, so `limit` bounds it; the tensors
    are copied once, into the packed copy."""
    try:
        if column_wire.is_columns(payload):  # each item made as the one before is packed
            return [Entry.of(item) for item in column_wire.read(payload).items(limit)]
        items = trxp.parse(payload, limit=limit)
        items.reverse()
        entries = []
        while items:  # each item's metadata is let go as its packed copy is made
            entries.append(Entry.of(items.pop()))
        return entries
    except trxp.TrxpError as exc:
        raise InvalidPayload(str(exc)) from None


class Region:
    """A shared file mapped in both processes; either side grows it when a payload or a
    push's packed experiences need more, and the other remaps when told its new size."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0
        self.map: mmap.mmap | None = None

    def fit(self, size: int) -> mmap.mmap:
        """Map at least `size` bytes (the file only grows; it may be larger than asked); return
        the map. A region is never mapped empty (mmap refuses that): an empty payload still maps one."""
        if self.map is not None and size <= self.size:
            return self.map
        if os.fstat(self.fd).st_size < max(size, 1):
            os.ftruncate(self.fd, max(size, 2 * self.size, _MIN_REGION))
        if self.map is not None:
            # A view of it may still be held (in a cycle not yet freed): it is unmapped as that goes.
            with contextlib.suppress(BufferError):
                self.map.close()
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, self.size)
        return self.map

    def release(self) -> None:
        """Give back the memory past _KEEP (the file keeps its size, reading zeros there)."""
        if self.map is not None and self.size > _KEEP and hasattr(mmap, "MADV_REMOVE"):
            self.map.madvise(mmap.MADV_REMOVE, _KEEP, self.size - _KEEP)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def serve(conn: Connection, region: Region, max_metadata_bytes: int) -> None:
    """Decode each payload put in the region, write the experiences' bytes back there one after
    another, and reply with their other fields, or the refusal, until the server closes the
    connection.

    It ignores the stop signals (STOP_SIGNALS), which a process group's stop sends it too: the
    server stops, and closes the pool (the worker ends when its connection does)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    limit = metadata_limit(max_metadata_bytes)
    message = pickle.dumps(FIELDS)  # imported and ready: the entries it makes, field by field
    while True:
        try:
            conn.send_bytes(message)
            length, size = REQUEST.unpack(conn.recv_bytes())
        except (EOFError, OSError):  # the server closed the pool, or ended (even while this one started)
            return
        region.fit(size)
        try:
            reply: Any = _pack(_decoded(region, length, limit), region)
        except Exception as exc:
            reply = exc
        try:
            message = pickle.dumps((reply, region.size), pickle.HIGHEST_PROTOCOL)
        except Exception:  # a refusal that does not pickle: the server decodes the push itself
            message = pickle.dumps((None, region.size), pickle.HIGHEST_PROTOCOL)
        reply = None  # a refusal's traceback holds views of the payload, which a remap of the region must not find


def _decoded(region: Region, length: int, limit: trxp.MetadataLimit) -> list[Entry]:
    """The entries of the payload the server put at the start of the region, decoded where it lies:
    a slice of the map is a copy of it (bytes), a view is not. The entries hold copies of what they
    keep (the packed payloads), never a view of the region, which their packing overwrites."""
    assert region.map is not None
    return entries_of(memoryview(region.map)[:length], limit)


def _pack(entries: list[Entry], region: Region) -> list[tuple]:
    """The entries' blobs written into the region in order; their fields, the blob's length in its place."""
    view = region.fit(sum(len(entry.blob) for entry in entries))
    rows, pos = [], 0
    for entry in entries:
        row = fields_of(entry)
        blob = row[BLOB]
        view[pos : pos + len(blob)] = blob
        pos += len(blob)
        rows.append((*row[:BLOB], len(blob), *row[BLOB + 1 :]))
    return rows


if __name__ == "__main__":
    conn_fd, region_fd, max_metadata = map(int, sys.argv[1:4])
    serve(Connection(conn_fd), Region(region_fd), max_metadata)
