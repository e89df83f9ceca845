"""The client's public surface as a user meets it: every public method says what it does."""

from __future__ import annotations

import importlib
import inspect

import pytest

from expbuf.client import AsyncBufferClient, BufferClient, ExpbufError

# Every public class of the client and its adapters, by module; an adapter's module needs its framework.
PUBLIC = {
    "expbuf.client": [
        "BufferClient", "AsyncBufferClient", "Batch", "GetResult", "PushResult", "Tls", "BufferStats", "TableStats",
        "TableInfo", "ShapingInfo", "ServerInfo",
    ],
    "expbuf.client.results": ["AsyncBatch", "ExperiencePage", "ListedExperience", "Grant"],
    "expbuf.client.shards.blocking": ["ShardedBufferClient", "AsyncShardedBufferClient", "ShardBatch", "ShardError"],
    "expbuf.client.trinity": ["ExpbufAdvantageFn", "ExpbufReader", "ExpbufSampleStrategy", "ExpbufWriter", "Location"],
    "expbuf.client.verl": ["ExpbufExternalTrainer", "ExpbufReplayBuffer", "Row", "Settings"],
    "expbuf.client.areal": [
        "ExpbufBatchSource", "ExpbufRemoteInfEngine", "ExpbufStalenessManager", "ExpbufWorkflow",
        "KeepExpbufAdvantages",
    ],
}  # fmt: skip
FRAMEWORK = {"expbuf.client.trinity": "trinity", "expbuf.client.verl": "verl", "expbuf.client.areal": "areal"}


@pytest.mark.parametrize(("module", "name"), [(module, name) for module, names in PUBLIC.items() for name in names])
def test_every_public_method_has_a_docstring(module: str, name: str) -> None:
    """Each public method and property of the class, its inherited ones included, has a docstring of
    its own or one it inherits from the method it overrides (a framework's, for an adapter's)."""
    if module in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[module])
    kind = getattr(importlib.import_module(module), name)
    assert vars(kind).get("__doc__"), f"{name} has no docstring"
    missing = []
    for attribute in dir(kind):
        owner = next((base for base in kind.__mro__ if attribute in vars(base)), None)
        if attribute.startswith("_") or owner is None or not owner.__module__.startswith("expbuf."):
            continue  # a framework's own members are the framework's to document
        member = inspect.getattr_static(kind, attribute)
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if (inspect.isfunction(member) or isinstance(member, property)) and not inspect.getdoc(
            getattr(kind, attribute)
        ):
            missing.append(f"{owner.__name__}.{attribute}")
    assert not missing, f"{name}: {missing} have no docstring"
    assert BufferClient.__init__.__doc__ and AsyncBufferClient.__init__.__doc__  # target, token, tls, timeout, ...


def test_every_error_says_when_it_is_raised() -> None:
    statuses = [kind for kind in ExpbufError.__subclasses__() if kind.__module__ == ExpbufError.__module__]
    assert len(statuses) >= 9
    for kind in statuses:
        assert kind.__doc__ and kind.status is not None, kind.__name__
