"""The sharded clients' reads of named experiences: each uid asked of the shard that owns its
group (get, read_fields), and a rank's part of a batch leased from several shards (read_part,
get_part), split over the ranks as one step. Plans, as plans.py's: the blocking and the asyncio
client run them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..columns import join_columns, run_lengths
from ..errors import BufferError
from ..results import FieldBatch, GetResult
from ..rpc.calls.read_calls import PartOptions, ReadPartOptions, check_part, split_of
from ..schema.balance import COSTS, ModelShape, split_runs
from ..schema.routing import uid_group_key
from .common import shard_error
from .plans import Planned
from .steps import Call, Plan, T, is_down


class ReadPlans(Planned):
    """The plans of the reads of named experiences."""

    def _get(self, uids: Iterable[str], table: str) -> Plan[GetResult]:
        """Each uid from the shard that owns its group (`_by_owner`). Raises ShardError
        (`result`: what was found) when a uid's owner is down."""
        uids = list(dict.fromkeys(uids))
        found, lost = yield from self._by_owner(
            uids, table, lambda shard, part: Call(shard, "get", (part, table), quick=None),
            lambda part: {exp.eid.uid: exp for exp in part},
        )  # fmt: skip
        result = GetResult([found[uid] for uid in uids if uid in found], [uid for uid in uids if uid not in found])
        if lost:
            raise shard_error(lost, self.shard_map.targets, result)
        return result

    def _read_fields(
        self, uids: Iterable[str], fields: Iterable[str], table: str, share: int | Iterable[int], of: int
    ) -> Plan[FieldBatch]:
        """Each uid's fields from the shard that owns its group (`_by_owner`), put together in
        request order. Raises ShardError (`result`: what was read) when a uid's owner is down."""
        uids, take = list(dict.fromkeys(uids)), share if isinstance(share, int) else tuple(share)
        fields = list(fields)
        shares = {"share": take, "of": of}
        found, lost = yield from self._by_owner(
            uids, table,
            lambda shard, part: Call(shard, "read_fields", (part, fields, table), shares, quick=None),
            lambda read: {uid: (read, at) for at, uid in enumerate(read.uids)},
        )  # fmt: skip
        order = [uid for uid in uids if uid in found]
        place = {id(found[uid][0]): found[uid][0] for uid in order}
        position = {(id(found[uid][0]), found[uid][1]): at for at, uid in enumerate(order)}
        columns = join_columns(
            [([position.get((key, at)) for at in range(len(read.uids))], read.columns) for key, read in place.items()],
            fields,
        )
        groups = [found[uid][0].group_ids[found[uid][1]] for uid in order]
        result = FieldBatch(order, groups, [uid for uid in uids if uid not in found], columns, table)
        if lost:
            raise shard_error(lost, self.shard_map.targets, result)
        return result

    def _read_part(
        self,
        lease_id: str,
        rank: int,
        ranks: int,
        fields: Iterable[str],
        table: str,
        options: ReadPartOptions,
    ) -> Plan[FieldBatch]:
        """Rank `rank`'s part of a batch leased from several shards (`_part_uids`, split as
        `options` say), its uids' fields read from their shards."""
        uids = yield from self._part_uids(lease_id, rank, ranks, table, split_of(options, "read_part"))
        return (yield from self._read_fields(uids, fields, table, options.get("share", ()), options.get("of", 0)))

    def _get_part(self, lease_id: str, rank: int, ranks: int, table: str, split: PartOptions) -> Plan[GetResult]:
        """Rank `rank`'s part of a batch leased from several shards, as whole experiences."""
        uids = yield from self._part_uids(lease_id, rank, ranks, table, split_of(split))
        return (yield from self._get(uids, table))

    def _part_uids(
        self, lease_id: str, rank: int, ranks: int, table: str, split: tuple[str, ModelShape | None, bool]
    ) -> Plan[list[str]]:
        """The uids of rank `rank`'s part of a batch leased from several shards: each shard's part
        of the lease is listed with its runs' tokens (ReadFields by its lease, for one rank: the
        lease's owner checked there), the groups of every shard split over the ranks as a server
        splits one lease's (schema/balance.py, `split` = balance, model, equal), the same split in
        every rank's process."""
        balance, model, equal = split
        check_part(lease_id, rank, ranks, balance, model)
        if balance not in COSTS:  # split here: a cost is this process's to know
            raise ValueError(f"balance {balance!r} is not one of {', '.join(COSTS)} (register_cost in this process)")
        calls = [
            Call(shard, "read_part", (lease, 0, 1, ["length"], table), {"balance": "count"})
            for shard, lease in self._leases(lease_id)
        ]
        outcomes = yield from self._exchange(calls)
        errors = {c.shard: o for c, o in zip(calls, outcomes, strict=True) if isinstance(o, BufferError)}
        if errors:
            raise shard_error(errors, self.shard_map.targets, None)
        uids = [uid for read in outcomes for uid in read.uids]
        groups = [group for read in outcomes for group in read.group_ids]
        lengths = [length for read in outcomes for length in run_lengths(read)]
        return split_runs(uids, groups, lengths, ranks, balance, model, equal)[rank]

    def _by_owner(
        self,
        uids: list[str],
        table: str,
        call: Callable[[str, list[str]], Call],
        found_in: Callable[[Any], dict[str, T]],
    ) -> Plan[tuple[dict[str, T], dict[str, BufferError]]]:
        """Each uid asked (`call` of a shard and its uids) of the shard that owns its group, or
        of every shard where its uid does not say its group; a uid its owner does not hold, or
        whose group cannot be read from it, is then asked of every other shard that answered.
        What was found by uid (`found_in` of a shard's result), and the owners that did not
        answer of uids not found."""
        group_by = yield from self._group_by_of(table)
        asked: dict[str, list[str]] = {}
        for uid in uids:
            key = uid_group_key(uid, group_by)
            for shard in [self.shard_map.owner(key)] if key is not None else self.clients:
                asked.setdefault(shard, []).append(uid)
        found, unanswered = yield from self._found(asked, call, found_in)
        rest = [uid for uid in uids if uid not in found]
        answered = [shard for shard in asked if shard not in unanswered] + [s for s in self.clients if s not in asked]
        again = {s: [uid for uid in rest if s not in asked or uid not in asked[s]] for s in answered}
        more, _ = yield from self._found({s: part for s, part in again.items() if part}, call, found_in)
        found = more | found
        lost = {s: exc for s, exc in unanswered.items() if any(uid not in found for uid in asked[s])}
        return found, lost

    def _found(
        self,
        asked: Mapping[str, list[str]],
        call: Callable[[str, list[str]], Call],
        found_in: Callable[[Any], dict[str, T]],
    ) -> Plan[tuple[dict[str, T], dict[str, BufferError]]]:
        """What the shards asked hold of their uids, and the shards that did not answer; a
        shard that refused raises ShardError."""
        calls = [call(shard, part) for shard, part in asked.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)) if calls else [])
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        if refused:
            raise shard_error(refused, self.shard_map.targets)
        found: dict[str, T] = {}
        for result in results.values():
            found = found_in(result) | found
        return found, errors
