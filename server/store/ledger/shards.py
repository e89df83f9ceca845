"""Which prompts a shard of a sharded table hands out; ledger.py's cursor skips the others.

A sharded client creates a dataset on every shard of its map's first epoch, naming them all
(`shards`) and the one it asks (`shard`). Its router sends the group of every attempt at a
prompt, `name/epoch/index@attempt`, to the rendezvous of `name/epoch/index` over those shards
(expbuf.client.schema.routing: the key less its `@attempt`; a dataset's name is no number, so epoch
0's shards, for good). A shard owns the prompts whose groups it is sent, and hands out only
those: a prompt's claims, its groups and its state meet on one shard, and over the shards
every prompt goes out once per epoch.

The epoch is in the key, so each epoch's part is its own, counted when the epoch starts: epoch
0's when the dataset is created, before its write, and each later one's when a claim's cursor
reaches it, before the transaction that enters it (services/claims.py), so the writer is not
held while it is counted (3 to 5 s per million prompts with three shards, docs/operations/
scaling-out.md, "The prompt ledger on shards") and a dataset of many epochs costs nothing per
epoch not started, as one server's does.
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


def count_part(ds: DatasetRecord, epoch: int, stop: Callable[[], bool] | None = None) -> int:
    """The prompts of one epoch a shard's part of a sharded dataset hands out; raises
    Cancelled once `stop()` says the caller gave up."""
    owned = 0
    for start in range(0, ds.size, _CHUNK):
        if stop is not None and stop():
            raise Cancelled(f"dataset {ds.name!r}: the caller gave up while its part of epoch {epoch} was counted")
        keys = (route(ds.name, epoch, index) for index in range(start, min(ds.size, start + _CHUNK)))
        owned += sum(shard == ds.shard for shard in owners(keys, ds.shards))
    return owned


def count_parts(ds: DatasetRecord, first: int, hashes: int, stop: Callable[[], bool] | None = None) -> dict[int, int]:
    """The parts of the epochs from `first` on, by epoch, as many as `hashes` ownership hashes
    count (one epoch at least): a claim whose cursor crosses many small epochs counts them
    at once, not one transaction each."""
    epochs = max(1, hashes // max(1, ds.size * len(ds.shards)))
    return {epoch: count_part(ds, epoch, stop) for epoch in range(first, min(ds.epochs, first + epochs))}
