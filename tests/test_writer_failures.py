"""The store's writer thread outlives what goes wrong around its requests (disk/environment/writer.py): a
request its caller cancelled before it ran is never run, and a failure of the writer's own (no
request's refusal) fails that batch's requests, nothing of them kept, where either one ended the
thread before and left every later caller waiting for good."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from expbuf.server.store import Store
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.schema.errors import StoreError

from helpers import held_writer


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path) as opened:
        yield opened


def _put(key: bytes) -> Any:
    def write(txn: lmdb.Transaction[bytes]) -> bytes:
        txn.put(key, b"1")
        return key

    return write


def _stored(environment: Environment, key: bytes) -> bool:
    return bool(environment.submit(lambda txn: txn.get(key) is not None))


def test_a_cancelled_request_is_not_run_and_the_writer_goes_on(store: Store) -> None:
    environment = store.environment
    go, held = held_writer(environment)
    cancelled = environment.queue(_put(b"cancelled"))
    kept = environment.queue(_put(b"kept"))
    assert cancelled.cancel()
    go.set()
    held.result(60)
    assert kept.result(60) == b"kept"
    assert not _stored(environment, b"cancelled") and _stored(environment, b"kept")


def test_a_failure_of_the_writer_itself_fails_its_batch_and_the_writer_goes_on(store: Store) -> None:
    """A `together` that answers for fewer requests than it ran (a defect of the writer's own code, not
    a request's refusal): the batch's requests fail with a StoreError that says nothing was stored, and
    nothing of them is; the next request is stored."""

    def short(txn: lmdb.Transaction[bytes], fns: list[Any]) -> list[tuple[bool, Any]]:
        return [(True, fn(txn)) for fn in fns[:-1]]

    environment = store.environment
    go, held = held_writer(environment)
    batch = [environment.queue(_put(key), together=short) for key in (b"a", b"b", b"c")]
    go.set()
    held.result(60)
    for future in batch:
        with pytest.raises(StoreError, match="nothing was stored"):
            future.result(60)
    assert not any(_stored(environment, key) for key in (b"a", b"b", b"c"))
    assert environment.submit(_put(b"after")) == b"after" and _stored(environment, b"after")
