"""The unpickler of the metadata pickle, which refuses every global. Kept apart from the scan
in pickles.py: mypyc compiles that module, and a compiled subclass of pickle.Unpickler (a C type)
crashes when it reads.
"""

from __future__ import annotations

import pickle
from typing import Any

from .common import TrxpError
from .shown import clip


class PlainUnpickler(pickle.Unpickler):
    """Reads plain data only: every global is refused, never looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise TrxpError(f"metadata: pickle references the global {clip(module)}.{clip(name)}; refused")

    def persistent_load(self, pid: Any) -> Any:
        raise TrxpError("metadata: pickle uses persistent ids; refused")


class _InPlace:
    """A file over bytes in memory that the unpickler reads where they are: its `peek` hands
    over every byte at once, so values are copied once, into the objects they become
    (io.BytesIO copies a memoryview whole before it is read)."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def peek(self, size: int = 0) -> memoryview:
        return self._data[self._pos :]

    def read(self, size: int = -1) -> Any:
        """A view, not bytes: the unpickler reads any buffer, and at its end reads here whatever
        it consumed from `peek`, the whole pickle."""
        end = len(self._data) if size < 0 else min(len(self._data), self._pos + size)
        data = self._data[self._pos : end]
        self._pos = end
        return data

    def readline(self) -> bytes:
        rest = bytes(self._data[self._pos :])  # reached only past a line's end that is not there
        line = rest[: rest.find(b"\n") + 1 or len(rest)]
        self._pos += len(line)
        return line


def load_plain(data: memoryview) -> Any:
    """The plain data of a pickle (PlainUnpickler), read without copying `data`."""
    return PlainUnpickler(_InPlace(data)).load()
