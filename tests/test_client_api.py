"""The client's public surface as a user meets it: every public method says what it does."""

from __future__ import annotations

import inspect

import pytest

from expbuf.client import AsyncBufferClient, BufferClient, ExpbufError, Tls
from expbuf.client.client import AsyncBatch, Batch, ExperiencePage, GetResult, ListedExperience, PushResult
from expbuf.client.results import BufferStats, ServerInfo, ShapingInfo, TableInfo, TableStats


@pytest.mark.parametrize(
    "kind",
    [
        BufferClient,
        AsyncBufferClient,
        Batch,
        AsyncBatch,
        GetResult,
        PushResult,
        Tls,
        ExperiencePage,
        ListedExperience,
        BufferStats,
        TableStats,
        TableInfo,
        ShapingInfo,
        ServerInfo,
    ],
)
def test_every_public_method_has_a_docstring(kind: type) -> None:
    assert kind.__doc__ and not kind.__doc__.startswith(kind.__name__ + "("), f"{kind.__name__} has no docstring"
    missing = [
        name
        for name, member in vars(kind).items()
        if not name.startswith("_") and inspect.isfunction(member) and not member.__doc__
    ]
    assert not missing, f"{kind.__name__}: {missing} have no docstring"
    assert BufferClient.__init__.__doc__ and AsyncBufferClient.__init__.__doc__  # target, token, tls, timeout, ...


def test_every_error_says_when_it_is_raised() -> None:
    statuses = [kind for kind in ExpbufError.__subclasses__() if kind.__module__ == ExpbufError.__module__]
    assert len(statuses) >= 9
    for kind in statuses:
        assert kind.__doc__ and kind.status is not None, kind.__name__
