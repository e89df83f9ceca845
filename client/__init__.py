"""expbuf client side: the TRXP codec, experience types and the gRPC clients.

The names below are imported when first used (PEP 562), so that `import expbuf.client.trxp`
(the codec, which the server's store reads payloads with) loads neither grpc nor the clients.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from .moved import serve

if TYPE_CHECKING:
    from .aio import AsyncBufferClient
    from .client import BufferClient
    from .errors import (
        AlreadyExistsError,
        BufferError,
        DataLossError,
        DeadlineExceededError,
        ExpbufError,
        FailedPreconditionError,
        InvalidArgumentError,
        NotFoundError,
        PermissionDeniedError,
        ResourceExhaustedError,
        UnauthenticatedError,
        UnavailableError,
    )
    from .results import (
        AsyncBatch,
        Batch,
        BufferStats,
        FailedRuns,
        FieldBatch,
        GetResult,
        PushResult,
        ScrubInfo,
        ServerInfo,
        ShapingInfo,
        TableInfo,
        TableStats,
    )
    from .rpc.connection import Tls
    from .schema.experience import EID, Experience, ordered_id
    from .schema.prompts import Claim, DatasetInfo, EpochCounts, Prompt, PromptPage, PromptState, PromptStats
    from .trxp import TrxpError, decode, encode
    from .trxp.column_batch.build import ColumnBatch


def _installed_client() -> str | None:
    """Where the installed expbuf keeps expbuf.client: the source tree an editable install maps it
    to (setuptools' finder), or the folder a wheel installed in Python's path; None if none is."""
    for name, module in list(sys.modules.items()):
        if name.startswith("__editable___expbuf_"):
            mapped = getattr(module, "MAPPING", {}).get(__name__)
            if mapped:
                return str(mapped)
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.join(os.path.abspath(entry or os.curdir), "expbuf", "client")
        if folder != here and os.path.isfile(os.path.join(folder, "__init__.py")):
            return folder
    return None


def _warn_if_shadowed() -> None:
    """Warn where a source tree of expbuf (a clone named `expbuf`, found first in Python's path,
    the current directory's) shadows the installed expbuf: `expbuf` is a namespace, so its
    `client` came from the clone's sources, not the install, without its compiled codec, and an
    edit to the clone changes what runs. Only a source tree holds pyproject.toml beside client/."""
    here = os.path.dirname(os.path.abspath(__file__))
    tree = os.path.dirname(here)
    if not os.path.isfile(os.path.join(tree, "pyproject.toml")):
        return
    installed = _installed_client()
    if installed is None or os.path.realpath(installed) == os.path.realpath(here):
        return
    warnings.warn(
        f"expbuf.client is imported from {tree}, a source tree in Python's path (the current directory, or "
        f"PYTHONPATH), not the installed expbuf ({installed}): the tree's sources run, not the install's, nor its "
        "compiled codec, and an edit to the tree changes what runs. Run Python from another directory, or keep the "
        'clone under another name (git clone URL expbuf-src; pip install "./expbuf-src[...]")',
        UserWarning,
        stacklevel=2,
    )


_warn_if_shadowed()

# The old paths of the client's modules that moved into folders by role (and of the codec's that
# the docs named, into its rooms by format), each served with no file until the next release:
# every name read from one is the new module's, with a DeprecationWarning (moved.py; CHANGELOG.md).
OLD_PATHS = {
    "expbuf.client.experience": "expbuf.client.schema.experience",
    "expbuf.client.prompts": "expbuf.client.schema.prompts",
    "expbuf.client.routing": "expbuf.client.schema.routing",
    "expbuf.client.table_presets": "expbuf.client.schema.table_presets",
    "expbuf.client.table_settings": "expbuf.client.schema.table_settings",
    "expbuf.client.sample_spec": "expbuf.client.rpc.sample_spec",
    "expbuf.client.wire": "expbuf.client.rpc.wire",
    "expbuf.client.sharded": "expbuf.client.shards.blocking",
    "expbuf.client.lease_keeper": "expbuf.client.kit.lease_keeper",
    "expbuf.client.location": "expbuf.client.kit.location",
    "expbuf.client.trxp.columns": "expbuf.client.trxp.stored.columns",
}
serve(OLD_PATHS)

# each public name -> the module of this package that defines it
_HOMES = {
    "AsyncBufferClient": "aio",
    "BufferClient": "client",
    "Tls": "rpc.connection",
    "AlreadyExistsError": "errors",
    "BufferError": "errors",
    "DataLossError": "errors",
    "DeadlineExceededError": "errors",
    "ExpbufError": "errors",
    "FailedPreconditionError": "errors",
    "InvalidArgumentError": "errors",
    "NotFoundError": "errors",
    "PermissionDeniedError": "errors",
    "ResourceExhaustedError": "errors",
    "UnauthenticatedError": "errors",
    "UnavailableError": "errors",
    "EID": "schema.experience",
    "Experience": "schema.experience",
    "ordered_id": "schema.experience",
    "Claim": "schema.prompts",
    "DatasetInfo": "schema.prompts",
    "EpochCounts": "schema.prompts",
    "Prompt": "schema.prompts",
    "PromptState": "schema.prompts",
    "PromptStats": "schema.prompts",
    "PromptPage": "schema.prompts",
    "AsyncBatch": "results",
    "Batch": "results",
    "BufferStats": "results",
    "FailedRuns": "results",
    "FieldBatch": "results",
    "GetResult": "results",
    "PushResult": "results",
    "ScrubInfo": "results",
    "ServerInfo": "results",
    "ShapingInfo": "results",
    "TableInfo": "results",
    "TableStats": "results",
    "ColumnBatch": "trxp.column_batch.build",
    "TrxpError": "trxp",
    "decode": "trxp",
    "encode": "trxp",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once: later reads find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "EID",
    "AlreadyExistsError",
    "AsyncBatch",
    "AsyncBufferClient",
    "Batch",
    "BufferClient",
    "BufferError",
    "BufferStats",
    "Claim",
    "ColumnBatch",
    "DataLossError",
    "DatasetInfo",
    "DeadlineExceededError",
    "EpochCounts",
    "ExpbufError",
    "Experience",
    "FailedPreconditionError",
    "FailedRuns",
    "FieldBatch",
    "GetResult",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "Prompt",
    "PromptPage",
    "PromptState",
    "PromptStats",
    "PushResult",
    "ResourceExhaustedError",
    "ScrubInfo",
    "ServerInfo",
    "ShapingInfo",
    "TableInfo",
    "TableStats",
    "Tls",
    "TrxpError",
    "UnauthenticatedError",
    "UnavailableError",
    "decode",
    "encode",
    "ordered_id",
]
