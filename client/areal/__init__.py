"""expbuf from AReaL: its trajectory rows as TRXP experiences (`to_areal`, `from_areal`), a
workflow that pushes its groups (`ExpbufWorkflow`), admission by the table
(`ExpbufStalenessManager`, `ExpbufRemoteInfEngine`), a trainer's batches from the table
(`ExpbufBatchSource`, `KeepExpbufAdvantages`), and table settings that agree with AReaL's
config (`table_settings`, `trainer_side`).

The workflow, the staleness manager and the engine import AReaL, on first use; the rest needs
torch only."""

from __future__ import annotations

from typing import Any

from .actor import KeepExpbufAdvantages
from .batch_source import ExpbufBatchSource
from .convert import EXPBUF_ADVANTAGES, TOKEN_VERSIONS, from_areal, to_areal
from .settings import table_settings, trainer_side

__all__ = [
    "EXPBUF_ADVANTAGES",
    "TOKEN_VERSIONS",
    "ExpbufBatchSource",
    "ExpbufRemoteInfEngine",
    "ExpbufStalenessManager",
    "ExpbufWorkflow",
    "KeepExpbufAdvantages",
    "from_areal",
    "table_settings",
    "to_areal",
    "trainer_side",
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
