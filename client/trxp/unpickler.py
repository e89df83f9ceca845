"""The unpickler of the metadata pickle, which refuses every global. Kept apart from the scan
in pickles.py: mypyc compiles that module, and a compiled subclass of pickle.Unpickler (a C type)
crashes when it reads.
"""

from __future__ import annotations

import pickle
from typing import Any

from .checks import clip
from .common import TrxpError


class PlainUnpickler(pickle.Unpickler):
    """Reads plain data only: every global is refused, never looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise TrxpError(f"metadata: pickle references the global {clip(module)}.{clip(name)}; refused")

    def persistent_load(self, pid: Any) -> Any:
        raise TrxpError("metadata: pickle uses persistent ids; refused")
