"""Which prompts a shard of a sharded table hands out; ledger.py's cursor skips the others.

A sharded client creates a dataset on every shard of its map's first epoch, naming them all
(`shards`) and the one it asks (`shard`). Its router sends the group of every attempt at a
prompt, `name/epoch/index@attempt`, to the rendezvous of `name/epoch/index` over those shards
(expbuf.client.schema.routing: the key less its `@attempt`; a dataset's name is no number, so epoch
0's shards, for good). A shard owns the prompts whose groups it is sent, and hands out only
those: a prompt's claims, its groups and its state meet on one shard, and over the shards
every prompt goes out once per epoch.

The epoch is in the key, so each epoch's part is its own. The parts are counted when the
dataset is created, before its write, so the writer is not held: 3 to 5 s per million prompts
per epoch with three shards (docs/operations/scaling-out.md, "The prompt ledger on shards"), where counting an epoch
when the cursor reaches it would hold every write of the shard that long mid-run.
"""

from __future__ import annotations

from collections.abc import Callable

from expbuf.client.schema.routing import owners, rendezvous

from ..schema.errors import Cancelled
from .records import DatasetRecord

_CHUNK = 65536  # prompts counted between looks at whether the caller gave up


def route(name: str, epoch: int, index: int) -> str:
    """The key the sharded clients' router hashes for every attempt at a prompt
    (routing.routing_key of ledger_records.group_key)."""
    return f"{name}/{epoch}/{index}"


def owns(ds: DatasetRecord, epoch: int, index: int) -> bool:
    """Whether this server hands out the prompt: always, unless the dataset is one shard's part."""
    return not ds.shards or rendezvous(route(ds.name, epoch, index), ds.shards) == ds.shard


def count_owned(ds: DatasetRecord, stop: Callable[[], bool] | None = None) -> list[int]:
    """The prompts of each epoch a shard's part of a sharded dataset hands out; raises
    Cancelled once `stop()` says the caller gave up."""
    return [_count(ds, epoch, stop) for epoch in range(ds.epochs)]


def _count(ds: DatasetRecord, epoch: int, stop: Callable[[], bool] | None) -> int:
    owned = 0
    for start in range(0, ds.size, _CHUNK):
        if stop is not None and stop():
            raise Cancelled(f"dataset {ds.name!r}: its creator gave up while its part was counted")
        keys = (route(ds.name, epoch, index) for index in range(start, min(ds.size, start + _CHUNK)))
        owned += sum(shard == ds.shard for shard in owners(keys, ds.shards))
    return owned
