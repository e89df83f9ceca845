"""Where a table's advantages can be computed, checked without loading torch for the tables
that do not ask for CUDA: a start and CreateTable stay quick and load no torch, which loads
in the background once a table needs advantages computed (start.py)."""

from __future__ import annotations

from ..store.schema.errors import ConfigError
from ..store.schema.table_config import TableConfig


def check_device(config: TableConfig) -> None:
    """Refuse a table that asks for CUDA on a server without it: its advantages could never
    be computed."""
    if config.advantages.device != "cuda":
        return
    import torch  # here: only a table that asks for CUDA needs it

    if not torch.cuda.is_available():
        raise ConfigError(f"table '{config.name}': device is 'cuda', but this server has no CUDA device")
