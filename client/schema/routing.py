"""Which shard owns a group: rendezvous hashing over an epoch-numbered shard map.

Every experience of a group must meet on one shard, where the group completes and its
advantages are computed. A group's key is the table's grouping of the experience id
(task, run or step id; the uid when the table groups by none), and its owner is the shard
with the highest hash of (shard name, key) among the shards of the group's epoch.

Epochs make adding shards safe. Epoch e lists its shards and the first rollout batch it
routes (`since_batch`): a group whose batch (the first part of every experience id, the
explore step in Trinity-RFT) is at least `since_batch` of the newest such epoch is routed
by that epoch's shards, older groups by the epoch they began in. Publishing epoch e+1 with
a `since_batch` a few steps ahead of the rollout therefore lets every writer adopt it
before its first group: groups already pending belong to older batches and finish where
they started, and of the new groups only those that hash to the added shard move to it.
A batch that is not an integer (nor a string starting with one, like "12/eval") belongs to
epoch 0, so such groups never move. Shards are named, and hashed by name, so a shard that
restarts at another address keeps its groups.

Every attempt at a prompt of the prompt ledger must land on the shard that holds the prompt.
Its group key is `name/epoch/index@attempt`, so a group key whose last part is
`<digits>@<digits>` (ASCII digits) is hashed without its `@<digits>` (`routing_key`): all its
attempts have one owner. A dataset's name starts with a letter, so its prompts belong to
epoch 0 and never move either; a shard of the ledger hands out the prompts whose
`name/epoch/index` it wins among epoch 0's shards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .experience import EID

# The part of the experience id that names its group, by the table's group_by.
GROUP_KEY_OF = {"task": "tid", "run": "rid", "step": "sid", "none": "uid"}
# A shard's name: it labels metrics and may be a pod's DNS label.
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_LEADING_INT = re.compile(r"(\d+)(?:/|$)")
_ATTEMPT = re.compile(r"([0-9]+)@[0-9]+")


class ShardMapError(ValueError):
    """A shard map that cannot route: bad names, epochs out of order, unknown shards."""


def group_key(eid: EID, group_by: str) -> str:
    """The id of the group an experience belongs to under a table's grouping."""
    try:
        return getattr(eid, GROUP_KEY_OF[group_by])
    except KeyError:
        raise ShardMapError(f"group_by is {group_by!r}; expected one of {', '.join(GROUP_KEY_OF)}") from None


def batch_number(key: str) -> int | None:
    """The rollout batch a group key begins with, or None when it is not a number (epoch 0).

    Every group key starts with the experience id's batch, so this reads the same number
    from the batch itself and from any of its keys.
    """
    match = _LEADING_INT.match(key)
    return int(match.group(1)) if match else None


def routing_key(key: str) -> str:
    """What rendezvous hashes for a group key: the key, less the `@attempt` of a last part
    `<digits>@<digits>` (an attempt at a prompt goes where the prompt is)."""
    head, slash, last = key.rpartition("/")
    match = _ATTEMPT.fullmatch(last)
    return f"{head}{slash}{match.group(1)}" if match else key


@functools.lru_cache(maxsize=4096)
def _keyed(shard: str) -> hashlib.blake2b:
    """The shard's keyed hash before any input: a copy of it is cheaper than keying anew."""
    return hashlib.blake2b(digest_size=8, key=shard.encode())


def _owner(data: bytes, keyed: list[tuple[hashlib.blake2b, str]]) -> str:
    top, owner = b"", ""
    for base, shard in keyed:
        score = base.copy()
        score.update(data)
        digest = score.digest()  # 8 big-endian bytes: they sort as the number
        if digest > top or (digest == top and shard > owner):
            top, owner = digest, shard
    return owner


def rendezvous(key: str, shards: Iterable[str]) -> str:
    """The shard with the highest hash for `key`: blake2b-64 of the key keyed by the shard's
    name (ties to the greater name). Adding a shard moves only the keys it wins."""
    return _owner(key.encode(), [(_keyed(shard), shard) for shard in shards])


def owners(keys: Iterable[str], shards: Iterable[str]) -> Iterator[str]:
    """`rendezvous` of each key over the same shards, faster for many keys."""
    keyed = [(_keyed(shard), shard) for shard in shards]
    return (_owner(key.encode(), keyed) for key in keys)


@dataclass(frozen=True)
class Epoch:
    number: int
    since_batch: int
    shards: tuple[str, ...]


@dataclass(frozen=True)
class ShardMap:
    """Epochs of shard names (oldest first) and each shard's current address."""

    epochs: tuple[Epoch, ...]
    targets: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.epochs:
            raise ShardMapError("a shard map needs at least one epoch")
        for index, epoch in enumerate(self.epochs):
            if epoch.number != index:
                raise ShardMapError(f"epoch {index} is numbered {epoch.number}; epochs count up from 0")
            if not epoch.shards:
                raise ShardMapError(f"epoch {index} has no shards")
            if len(set(epoch.shards)) != len(epoch.shards):
                raise ShardMapError(f"epoch {index} names a shard twice: {list(epoch.shards)}")
            for name in epoch.shards:
                if not SHARD_NAME.fullmatch(name):
                    raise ShardMapError(
                        f"shard name {name[:80]!r} must be 1-63 letters, digits, '.', '_' or '-' (not first)"
                    )
            if index and epoch.since_batch <= self.epochs[index - 1].since_batch:
                raise ShardMapError(
                    f"epoch {index} starts at batch {epoch.since_batch}, not after epoch {index - 1}"
                    f" (batch {self.epochs[index - 1].since_batch})"
                )
        missing = sorted(set(self.shards) - set(self.targets))
        if missing:
            raise ShardMapError(f"no address for shard(s) {', '.join(missing)}")

    @classmethod
    def of(cls, targets: Mapping[str, str] | Iterable[str]) -> ShardMap:
        """A one-epoch map: {name: target}, or a list of targets named shard-0, shard-1, ..."""
        if not isinstance(targets, Mapping):
            targets = {f"shard-{index}": target for index, target in enumerate(targets)}
        return cls((Epoch(0, 0, tuple(targets)),), dict(targets))

    @property
    def epoch(self) -> int:
        return self.epochs[-1].number

    @property
    def shards(self) -> tuple[str, ...]:
        """Every shard of every epoch: old shards keep serving the groups begun on them."""
        return tuple(dict.fromkeys(name for epoch in self.epochs for name in epoch.shards))

    def epoch_of(self, key: str) -> Epoch:
        """The epoch that routes a group: the newest one whose since_batch the key's batch reached."""
        number = batch_number(key)
        if number is None:
            return self.epochs[0]
        return next((e for e in reversed(self.epochs) if number >= e.since_batch), self.epochs[0])

    def owner(self, key: str) -> str:
        """The shard that owns the group with this key (every attempt at a prompt: one owner)."""
        return rendezvous(routing_key(key), self.epoch_of(key).shards)

    def add_shard(self, name: str, target: str, since_batch: int) -> ShardMap:
        """A new epoch with one more shard, routing groups of batches from `since_batch` on."""
        if name in self.epochs[-1].shards:
            raise ShardMapError(f"shard {name} is already in epoch {self.epoch}")
        epoch = Epoch(self.epoch + 1, since_batch, (*self.epochs[-1].shards, name))
        return ShardMap((*self.epochs, epoch), {**self.targets, name: target})

    def with_targets(self, targets: Mapping[str, str]) -> ShardMap:
        """The same epochs with new addresses (shards that restarted elsewhere)."""
        return ShardMap(self.epochs, {**self.targets, **targets})

    def to_json(self) -> str:
        epochs = [{"epoch": e.number, "since_batch": e.since_batch, "shards": list(e.shards)} for e in self.epochs]
        return json.dumps({"epochs": epochs, "targets": dict(self.targets)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, targets: Mapping[str, str] | None = None) -> ShardMap:
        """Read `to_json`'s form; `targets` adds or replaces addresses (found by discovery)."""
        raw, epochs = _read(text)
        return cls(epochs, {**raw.get("targets", {}), **(targets or {})})


def _read(text: str | bytes) -> tuple[dict[str, Any], tuple[Epoch, ...]]:
    try:
        raw: dict[str, Any] = json.loads(text)
        epochs = tuple(
            Epoch(int(e["epoch"]), int(e["since_batch"]), tuple(str(s) for s in e["shards"])) for e in raw["epochs"]
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ShardMapError(f"not a shard map: {exc!s:.200}") from None
    return raw, epochs


def shard_names(text: str | bytes) -> list[str]:
    """The shards a shard map's JSON names, in every epoch (addresses may be absent)."""
    return list(dict.fromkeys(name for epoch in _read(text)[1] for name in epoch.shards))


def uid_group_key(uid: str, group_by: str) -> str | None:
    """The group key of an experience known only by its uid, or None when the uid is not one.

    Only the batch may hold '/', so the other four parts are read from the right.
    """
    parts = uid.rsplit("/", 4)
    if len(parts) != 5 or not (parts[2].isdigit() and parts[3].isdigit()):
        return None
    batch, task, run, step, _ = parts
    keys = {"task": f"{batch}/{task}", "run": f"{batch}/{task}/{run}", "step": f"{batch}/{task}/{step}", "none": uid}
    return keys.get(group_by)
