"""The sharded clients' keyed values (put_values, get_values, clear_values): each key on one
shard, chosen by rendezvous over the shards of the map's first epoch, so that a key's shard never
changes as shards are added (values are not groups: they do not move to a new epoch). Plans, as
plans.py's: the blocking and the asyncio client run them."""

from __future__ import annotations

from collections.abc import Sequence

from ..schema.routing import owners
from .common import shard_error
from .plans import Planned
from .steps import Call, Plan


class ValuePlans(Planned):
    """The plans of keyed values over shards."""

    def _by_key(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """The positions of the keys each shard holds."""
        at: dict[str, list[int]] = {}
        for position, shard in enumerate(owners(keys, self.shard_map.epochs[0].shards)):
            at.setdefault(shard, []).append(position)
        return at

    def _put_values(self, keys: Sequence[str], values: Sequence[bytes], table: str) -> Plan[int]:
        """Each value on its key's shard; how many were stored. Raises ShardError naming a shard
        that did not answer or refused, its `result` what the others stored, by shard (a retry of
        the whole call is safe: a put stores the same bytes again)."""
        if len(keys) != len(values):
            raise ValueError(f"put_values: {len(keys)} keys for {len(values)} values, one value a key")
        at = self._by_key(keys)
        calls = [
            Call(shard, "put_values", ([keys[i] for i in part], [values[i] for i in part], table))
            for shard, part in at.items()
        ]
        results, errors = self._sort(calls, (yield from self._exchange(calls)) if calls else [])
        if errors:
            raise shard_error(errors, self.shard_map.targets, results)
        return sum(results.values())

    def _get_values(self, keys: Sequence[str], table: str, only_own: bool) -> Plan[list[bytes | None]]:
        """The value of each key from its shard, in the order asked, None for one not stored (with
        `only_own`, refused for another token's). Raises ShardError naming a shard that did not
        answer or refused."""
        at = self._by_key(keys)
        own = {"only_own": only_own}
        calls = [Call(shard, "get_values", ([keys[i] for i in part], table), own) for shard, part in at.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)) if calls else [])
        if errors:
            raise shard_error(errors, self.shard_map.targets)
        found: list[bytes | None] = [None] * len(keys)
        for shard, part in at.items():
            for position, value in zip(part, results[shard], strict=True):
                found[position] = value
        return found

    def _clear_values(self, keys: Sequence[str], table: str) -> Plan[int]:
        """Each key cleared on its shard; how many held a value. Raises ShardError as put_values."""
        at = self._by_key(keys)
        calls = [Call(shard, "clear_values", ([keys[i] for i in part], table)) for shard, part in at.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)) if calls else [])
        if errors:
            raise shard_error(errors, self.shard_map.targets, results)
        return sum(results.values())
