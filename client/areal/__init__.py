"""expbuf from AReaL: its trajectory rows as TRXP experiences (`to_areal`, `from_areal`), a
workflow that pushes its groups (`ExpbufWorkflow`), admission by the table
(`ExpbufStalenessManager`, `ExpbufRemoteInfEngine`).

`to_areal` and `from_areal` need torch only; the rest imports AReaL, on first use."""

from __future__ import annotations

from typing import Any

from .convert import TOKEN_VERSIONS, from_areal, to_areal

__all__ = [
    "TOKEN_VERSIONS",
    "ExpbufRemoteInfEngine",
    "ExpbufStalenessManager",
    "ExpbufWorkflow",
    "from_areal",
    "to_areal",
]

_LAZY = {
    "ExpbufWorkflow": ".workflow",
    "ExpbufStalenessManager": ".staleness",
    "ExpbufRemoteInfEngine": ".engine",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name], __name__), name)
