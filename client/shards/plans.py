"""The sharded clients' logic, free of I/O, that the blocking and the asyncio client both run.

Each call is a plan: a generator that yields the shard calls to make in parallel (a list of
`Call`), a pause (`Wait`) or, while sampling (sampling.py), a batch for the caller (`Emit`; all
three in steps.py), and is sent back the calls' outcomes (each a result or the BufferError it raised). The drivers in
blocking.py and aio.py only make the calls, with threads or with asyncio.

A shard that does not answer (UNAVAILABLE or DEADLINE_EXCEEDED) degrades a call instead of
failing it where the call can do without it: a sample draws from the others, stats and
server_info return the shards that answered and name the others in `missing`, a get answers
from each uid's owner, and a trainer version or a table created with exist_ok is owed to
the missing shard and sent first thing the next time it answers. A shard believed down is
asked with one attempt and a short deadline, so a trainer's step does not wait for retries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import grpc

from ..errors import BufferError
from ..results import BufferStats, FailedRuns, Grant, PushResult, ServerInfo, TableInfo, TableStats
from ..rpc import calls
from ..schema.experience import Experience
from ..schema.reasons import Reason
from ..schema.routing import uid_group_key
from ..schema.table_presets import with_preset
from .common import LiveResult, Sharded, merge_push, shard_error
from .steps import Call, Plan, is_down, shows_down

_log = logging.getLogger("expbuf.client")

# The leases whose parts a client keeps after an ack or a nack that failed on some of its shards.
MAX_ENDED = 4096


class Owed:
    """What the client still owes shards that missed a call: tables dropped, then tables created
    with exist_ok, then datasets created with exist_ok (their tables first), then trainer versions
    (the latest per table). Shared by the threads of one blocking client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drops: dict[str, set[str]] = {}
        self._creates: dict[str, dict[str, dict[str, Any]]] = {}
        self._datasets: dict[str, dict[tuple[str, str], tuple[int, dict[str, Any]]]] = {}
        self._versions: dict[str, dict[str, int]] = {}

    def create(self, shard: str, name: str, settings: dict[str, Any]) -> None:
        with self._lock:
            self._creates.setdefault(shard, {})[name] = settings

    def dataset(self, shard: str, table: str, name: str, size: int, settings: dict[str, Any]) -> None:
        with self._lock:
            self._datasets.setdefault(shard, {})[(table, name)] = (size, settings)

    def drop(self, shard: str, table: str) -> None:
        """A drop the shard missed: made before anything else it is owed, so that a table or dataset
        created again with exist_ok meanwhile does not meet the one dropped (its ledger and groups)."""
        with self._lock:
            self._drops.setdefault(shard, set()).add(table)

    def version(self, shard: str, table: str, version: int) -> None:
        with self._lock:
            self._versions.setdefault(shard, {})[table] = version

    def forget(self, table: str) -> None:
        """Nothing more is owed for a table (it was dropped; a drop owed stays)."""
        with self._lock:
            for creates in self._creates.values():
                creates.pop(table, None)
            for datasets in self._datasets.values():
                for key in [key for key in datasets if key[0] == table]:
                    del datasets[key]
            for versions in self._versions.values():
                versions.pop(table, None)

    def forget_versions(self, table: str) -> None:
        """No trainer version is owed for a table any more (an admin reset it)."""
        with self._lock:
            for owed in self._versions.values():
                owed.pop(table, None)

    def calls(self, shard: str) -> list[Call]:
        """The owed calls of a shard, in the order they must be made: creations first."""
        with self._lock:
            drops = [Call(shard, "drop_table", (name,), quick=None) for name in sorted(self._drops.get(shard, ()))]
            creates = [
                Call(shard, "create_table", (name,), {"exist_ok": True, **settings}, quick=None)
                for name, settings in self._creates.get(shard, {}).items()
            ]
            datasets = [  # the whole timeout, as the create had: the shard counts its part first
                Call(shard, "create_dataset", (table, name, size), {"exist_ok": True, **settings})
                for (table, name), (size, settings) in self._datasets.get(shard, {}).items()
            ]
            versions = [
                Call(shard, "set_trainer_version", (version, table), quick=True)
                for table, version in self._versions.get(shard, {}).items()
            ]
        return drops + creates + datasets + versions

    def settle(self, call: Call, outcome: Any) -> None:
        """An owed call answered: it is paid (or refused, and dropped with a warning) unless the
        shard was down, or a newer one took its place meanwhile."""
        if is_down(outcome):
            return
        if call.method == "drop_table":  # dropped, or had none (NOT_FOUND): paid
            if isinstance(outcome, BufferError) and outcome.code != grpc.StatusCode.NOT_FOUND:
                _log.warning("shard %s refused the owed drop_table%s: %s", call.shard, call.args, outcome)
            with self._lock:
                self._drops.get(call.shard, set()).discard(call.args[0])
            return
        if isinstance(outcome, BufferError):
            _log.warning("shard %s refused the owed %s%s: %s", call.shard, call.method, call.args, outcome)
        owed: dict[Any, Any]  # the create_table keywords by table, the create_dataset's by (table, name), a version
        value: Any
        with self._lock:
            settings = {k: v for k, v in call.kwargs.items() if k != "exist_ok"}
            if call.method == "create_table":
                owed, key, value = self._creates.get(call.shard, {}), call.args[0], settings
            elif call.method == "create_dataset":
                owed, key, value = self._datasets.get(call.shard, {}), call.args[:2], (call.args[2], settings)
            else:
                owed, key, value = self._versions.get(call.shard, {}), call.args[1], call.args[0]
            if owed.get(key) == value:
                del owed[key]

    def pending(self) -> dict[str, list[tuple[Any, ...]]]:
        """Per shard, what it is owed: ("drop_table", name), ("create_table", name),
        ("create_dataset", table, name) and ("trainer_version", table, version)."""
        with self._lock:
            shards = {*self._drops, *self._creates, *self._datasets, *self._versions}
            owed = {
                shard: [("drop_table", name) for name in sorted(self._drops.get(shard, ()))]
                + [("create_table", name) for name in self._creates.get(shard, {})]
                + [("create_dataset", *key) for key in self._datasets.get(shard, {})]
                + [("trainer_version", t, v) for t, v in self._versions.get(shard, {}).items()]
                for shard in sorted(shards)
            }
            return {shard: calls for shard, calls in owed.items() if calls}


class Ended:
    """The parts of leases this client acked or nacked where another part of the same lease
    failed (lease id: shard: (method, experiences)), so that the call made again ends only the
    rest. The newest MAX_ENDED leases are kept: a lease never ended again is forgotten in time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, dict[str, tuple[str, int]]] = {}

    def of(self, lease_id: str) -> dict[str, tuple[str, int]]:
        with self._lock:
            return dict(self._parts.get(lease_id, {}))

    def keep(self, lease_id: str, parts: dict[str, tuple[str, int]]) -> None:
        with self._lock:
            self._parts.pop(lease_id, None)
            if parts:
                self._parts[lease_id] = parts
            while len(self._parts) > MAX_ENDED:
                del self._parts[next(iter(self._parts))]

    def forget(self, lease_id: str) -> None:
        with self._lock:
            self._parts.pop(lease_id, None)


class Planned(Sharded):
    """The plans of every sharded call; a driver runs them (`_run`, and its sample loop)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owed = Owed()
        self._ended = Ended()
        self._down: set[str] = set()

    @property
    def pending(self) -> dict[str, list[tuple[Any, ...]]]:
        """What shards that did not answer are still owed, sent when each next answers."""
        return self._owed.pending()

    # ---- the exchange every plan goes through ---------------------------------------------

    def _exchange(self, calls: list[Call]) -> Plan[list[Any]]:
        """The calls' outcomes, in order. Each shard is first sent what it is owed; a shard that
        proves down doing so is not called again and its calls get that outcome."""
        skipped: dict[str, Any] = {}
        queues = {shard: self._owed.calls(shard) for shard in dict.fromkeys(call.shard for call in calls)}
        while any(queues.values()):
            owed = [queue.pop(0) for queue in queues.values() if queue]
            for call, outcome in zip(owed, (yield from self._direct(owed)), strict=True):
                self._owed.settle(call, outcome)
                if is_down(outcome):
                    skipped[call.shard], queues[call.shard] = outcome, []
        live = [call for call in calls if call.shard not in skipped]
        answers = iter((yield from self._direct(live)) if live else [])
        return [skipped[call.shard] if call.shard in skipped else next(answers) for call in calls]

    def _direct(self, calls: list[Call]) -> Plan[list[Any]]:
        """Make the calls, and learn from them which shards are down. A call that may degrade
        (`quick` None) to a shard believed down is made once a quick ServerInfo (the probe: one
        attempt, a short deadline) finds the shard answering, then with its full client; where the
        probe gets no answer, the call gets its outcome, unmade. Made with the probe itself, a call
        that takes the shard longer than the probe's deadline (a claim that counts its part of a
        new epoch, a claim's wait) never answered in time, and the shard stayed believed down."""
        doubtful = sorted({c.shard for c in calls if c.quick is None and c.shard in self._down})
        silent: dict[str, Any] = {}
        if doubtful:
            probes = [Call(shard, "server_info", quick=True) for shard in doubtful]
            for probe, answer in zip(probes, (yield probes), strict=True):
                if is_down(answer):
                    silent[probe.shard] = answer
                else:
                    self._down.discard(probe.shard)
        made = [replace(c, quick=bool(c.quick)) for c in calls if not (c.quick is None and c.shard in silent)]
        answers = iter((yield made) if made else [])
        outcomes = [silent[c.shard] if c.quick is None and c.shard in silent else next(answers) for c in calls]
        for call, outcome in zip(calls, outcomes, strict=True):
            down = shows_down(call, outcome)
            if down:
                self._down.add(call.shard)
            elif down is not None:
                self._down.discard(call.shard)
        return outcomes

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> Plan[dict[str, Any]]:
        """`method` on every shard; raises ShardError naming the shards that failed."""
        calls = [Call(shard, method, args, kwargs) for shard in self.clients]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        if errors:
            raise shard_error(errors, self.shard_map.targets, results)
        return results

    def _live(self, method: str, *args: Any, **kwargs: Any) -> Plan[LiveResult]:
        """`method` on every shard, degraded: the shards that answered, the others in `missing`.

        A shard that refuses the call still fails it; with no shard answering it fails UNAVAILABLE.
        """
        return (yield from self._live_on(self.clients, method, *args, **kwargs))

    def _live_on(self, shards: Iterable[str], method: str, /, *args: Any, **kwargs: Any) -> Plan[LiveResult]:
        """`_live` on these shards."""
        calls = [Call(shard, method, args, kwargs, quick=None) for shard in shards]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        missing = {shard: exc for shard, exc in errors.items() if is_down(exc)}
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        if refused or not results:
            raise shard_error(refused or missing, self.shard_map.targets, results)
        return LiveResult(results, {shard: str(exc) for shard, exc in missing.items()})

    def _on_one(self, shard: str, method: str, *args: Any, **kwargs: Any) -> Plan[Any]:
        (outcome,) = yield from self._exchange([Call(shard, method, args, kwargs)])
        if isinstance(outcome, BufferError):
            raise shard_error({shard: outcome}, self.shard_map.targets)
        return outcome

    @staticmethod
    def _sort(calls: list[Call], outcomes: list[Any]) -> tuple[dict[str, Any], dict[str, BufferError]]:
        results = {c.shard: o for c, o in zip(calls, outcomes, strict=True) if not isinstance(o, BufferError)}
        errors = {c.shard: o for c, o in zip(calls, outcomes, strict=True) if isinstance(o, BufferError)}
        return results, errors

    # ---- tables ----------------------------------------------------------------------------

    def _list_tables(self) -> Plan[list[TableInfo]]:
        """The tables of the first shard that answers, the shards believed up first."""
        last: dict[str, BufferError] = {}
        for shard in sorted(self.clients, key=lambda name: name in self._down):
            (outcome,) = yield from self._exchange([Call(shard, "list_tables", quick=None)])
            if not isinstance(outcome, BufferError):
                return self._remember(outcome)
            last[shard] = outcome
        raise shard_error(last, self.shard_map.targets)

    def _group_by_of(self, table: str) -> Plan[str]:
        if table not in self._group_by:
            yield from self._list_tables()
        return self._known_group_by(table)

    def _create_table(
        self, name: str, exist_ok: bool, preset: str | None, settings: Mapping[str, Any]
    ) -> Plan[TableInfo]:
        """On every shard, the preset expanded here; with exist_ok, a shard that does not answer is
        owed the table."""
        settings = with_preset(preset, settings)
        calls = [Call(s, "create_table", (name,), {"exist_ok": exist_ok, **settings}, None) for s in self.clients]
        configs, errors = self._sort(calls, (yield from self._exchange(calls)))
        missing = {shard: exc for shard, exc in errors.items() if is_down(exc)} if exist_ok else {}
        for shard in missing:
            self._owed.create(shard, name, dict(settings))
        refused = {shard: exc for shard, exc in errors.items() if shard not in missing}
        if refused or not configs:
            raise shard_error(refused or missing, self.shard_map.targets, configs)
        config: TableInfo = next(iter(configs.values()))
        self._group_by[name] = config.group_by or "task"
        return replace(config, missing={shard: str(exc) for shard, exc in missing.items()})

    def _reset_offpolicy(self, table: str, trainer_version: int | None) -> Plan[dict[str, dict[str, int]]]:
        """On every shard; an owed newer version is forgotten first, so it cannot undo the reset
        on a shard that was down when it was owed."""
        self._owed.forget_versions(table)
        return (yield from self._on_all("reset_offpolicy", table, trainer_version))

    def _drop_table(self, name: str) -> Plan[int]:
        """On every shard; the experiences dropped. A shard without the table (NOT_FOUND) has it
        dropped, by a drop made before that another shard's failure raised (NOT_FOUND from every
        shard: no such table). A shard that cannot be reached is owed the drop, made before what
        else it is owed when it is next reached (a create with exist_ok meanwhile would have met the
        table dropped: its ledger, its groups); the call raises ShardError naming it all the same."""
        self._group_by.pop(name, None)
        self._owed.forget(name)
        calls = [Call(shard, "drop_table", (name,)) for shard in self.clients]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        for shard, exc in errors.items():
            if is_down(exc):
                self._owed.drop(shard, name)
        absent = {shard for shard, exc in errors.items() if exc.code == grpc.StatusCode.NOT_FOUND}
        nowhere = not results and absent == set(errors)
        failed = {shard: exc for shard, exc in errors.items() if shard not in absent or nowhere}
        if failed:
            raise shard_error(failed, self.shard_map.targets, results)
        return sum(results.values())

    # ---- pushing and admin (reads: reads.py) --------------------------------------------------

    def _push(self, items: calls.Items, table: str, timeout: float | None) -> Plan[PushResult]:
        """Each group's part to its shard, in parallel; ShardError's `result` is what the others stored."""
        parts = self.split(items, (yield from self._group_by_of(table)))
        calls = [Call(shard, "push", (part, table), {"timeout": timeout}) for shard, part in parts.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        if errors:
            raise shard_error(errors, self.shard_map.targets, merge_push(results.values()))
        return merge_push(results.values())

    def _retire(self, groups: Iterable[str], table: str) -> Plan[int]:
        """Each group on the shard that owns it; the groups retired over all of them. Raises
        ShardError naming a shard that did not answer or refused, its `result` what each of the
        others retired, by shard."""
        parts: dict[str, list[str]] = {}
        for group in dict.fromkeys(groups):
            parts.setdefault(self.shard_map.owner(group), []).append(group)
        calls = [Call(shard, "retire", (part, table)) for shard, part in parts.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)) if calls else [])
        if errors:
            raise shard_error(errors, self.shard_map.targets, results)
        return sum(results.values())

    def _fail_runs(self, uids: Iterable[str], reasons: Iterable[str], table: str) -> Plan[FailedRuns]:
        """Each failed run reported to the shard that owns its group; what they did, together.
        Raises ShardError naming a shard that did not answer or refused, its `result` what the
        others did, by shard; a uid that names no group is refused (ValueError) before any call."""
        uids, reasons = list(uids), list(reasons)
        if reasons and len(reasons) != len(uids):
            raise ValueError(f"fail_runs: {len(uids)} uids for {len(reasons)} reasons, one reason a uid or none")
        group_by = yield from self._group_by_of(table)
        parts: dict[str, tuple[list[str], list[str]]] = {}
        for at, uid in enumerate(uids):
            key = uid_group_key(uid, group_by)
            if key is None:
                raise ValueError(f"fail_runs: {uid[:80]!r} is not an experience uid (batch/task/run/step/suffix)")
            part = parts.setdefault(self.shard_map.owner(key), ([], []))
            part[0].append(uid)
            part[1].extend([reasons[at]] if reasons else [])
        calls = [Call(shard, "fail_runs", (part[0], table), {"reasons": part[1]}) for shard, part in parts.items()]
        results, errors = self._sort(calls, (yield from self._exchange(calls)) if calls else [])
        if errors:
            raise shard_error(errors, self.shard_map.targets, results)
        done = list(results.values())
        return FailedRuns(
            [uid for one in done for uid in one.recorded],
            [gkey for one in done for gkey in one.completed_groups],
            [gkey for one in done for gkey in one.dropped_groups],
        )

    def _get_partials(self, task_ids: Iterable[str], table: str) -> Plan[list[Experience]]:
        """From every shard, in the order of the shards' names."""
        found = yield from self._on_all("get_partials", list(task_ids), table)
        return [exp for shard in sorted(found) for exp in found[shard]]

    def _delete(self, uids: Iterable[str], table: str, groups: Iterable[str]) -> Plan[int]:
        return sum((yield from self._on_all("delete", list(uids), table, groups=list(groups))).values())

    def _seal(self, group_id: str, table: str) -> Plan[int]:
        """On the shard that owns the group."""
        return (yield from self._on_one(self.shard_map.owner(group_id), "seal", group_id, table))

    def _stats(self, table: str) -> Plan[BufferStats]:
        """Each table's stats merged over the shards that answered (TableStats.merged)."""
        per_shard = yield from self._live("stats", table)
        parts: dict[str, list[TableStats]] = {}
        for stats in per_shard.values():
            for name, part in stats.items():
                parts.setdefault(name, []).append(part)
        return BufferStats({name: TableStats.merged(p) for name, p in parts.items()}, per_shard.missing)

    def _shard_stats(self, table: str) -> Plan[LiveResult]:
        """Each answering shard's stats, by shard (`_live`)."""
        return (yield from self._live("stats", table))

    def _server_info(self) -> Plan[ServerInfo]:
        per_shard = yield from self._live("server_info")
        return ServerInfo.merged(per_shard, per_shard.missing)

    # ---- the trainer's side ------------------------------------------------------------------

    def _set_trainer_version(self, version: int, table: str, need_answer: bool = True) -> Plan[int]:
        """Set on every shard that answers, owed to the others; the lowest version a shard holds
        (the version asked, when no shard answered and no answer was needed).

        One short attempt each: a shard that misses it is owed it, so a trainer's step never waits
        for retries, or a whole deadline, on a shard that does not answer."""
        calls = [Call(shard, "set_trainer_version", (version, table), quick=True) for shard in self.clients]
        results, errors = self._sort(calls, (yield from self._exchange(calls)))
        for shard, exc in errors.items():
            if is_down(exc):
                self._owed.version(shard, table, version)
        refused = {shard: exc for shard, exc in errors.items() if not is_down(exc)}
        if refused or (need_answer and not results):
            raise shard_error(refused or errors, self.shard_map.targets, results)
        return min(results.values(), default=version)

    def _renew(self, lease_id: str, seconds: float, table: str) -> Plan[float]:
        """Renew each part of a batch's lease on the shard that granted it; the earliest end. The
        parts this client acked or nacked already (`Ended`: an ack or a nack that failed on
        another part) are left out, as their shards no longer know them; a lease whose parts
        were all ended so is refused NOT_FOUND naming them."""
        pairs, ended = self._leases(lease_id), self._ended.of(lease_id)
        calls = [Call(shard, "renew", (lease, seconds, table)) for shard, lease in pairs if shard not in ended]
        if not calls:
            raise shard_error(
                {shard: self._ended_already(lease, ended[shard][0]) for shard, lease in pairs}, self.shard_map.targets
            )
        outcomes = yield from self._exchange(calls)
        errors = {c.shard: o for c, o in zip(calls, outcomes, strict=True) if isinstance(o, BufferError)}
        if errors:
            raise shard_error(errors, self.shard_map.targets)
        return min(outcomes)

    def _end(self, lease_id: str, method: str, table: str) -> Plan[int]:
        """Ack or nack each part of a batch's lease on the shard that granted it; the experiences
        of every part. Where some shards failed theirs (ShardError, `result` what the others
        did), the parts the others ended are kept (`Ended`): the call made again ends only the
        rest, as a shard refuses a lease it ended already, and counts them with it."""
        pairs = self._leases(lease_id)
        before, errors = self._ended.of(lease_id), {}
        for shard, lease in pairs:
            if shard in before and before[shard][0] != method:
                errors[shard] = self._ended_already(lease, before[shard][0])
        calls = [Call(shard, method, (lease, table)) for shard, lease in pairs if shard not in before]
        outcomes = (yield from self._exchange(calls)) if calls else []
        ended = {shard: how for shard, how in before.items() if how[0] == method}
        for call, outcome in zip(calls, outcomes, strict=True):
            if isinstance(outcome, BufferError):
                errors[call.shard] = outcome
            else:
                ended[call.shard] = (method, outcome)
        done = sum(count for _, count in ended.values())
        if errors:
            self._ended.keep(lease_id, {**before, **ended})
            raise shard_error(errors, self.shard_map.targets, done)
        self._ended.forget(lease_id)
        return done

    @staticmethod
    def _ended_already(lease: str, method: str) -> BufferError:
        """The refusal of a call on a lease's part that this client acked or nacked (`method`) already."""
        return BufferError(
            grpc.StatusCode.NOT_FOUND,
            f"its part of the lease (lease {lease!r}) was {method}ed already by this client",
            Reason.NOT_FOUND,
        )

    def _admit(self, table: str, count: int, wait: float, grant_seconds: float, grant_id: str | None) -> Plan[Grant]:
        shard, options = (
            self.admission_shard(table),
            {"wait": wait, "grant_seconds": grant_seconds, "grant_id": grant_id},
        )
        return (yield from self._on_one(shard, "admit", table, count, **options))

    def _finish_grant(self, grant: Grant, accepted: int | None) -> Plan[int]:
        """On the shard that granted it: the table's admission shard."""
        return (yield from self._on_one(self.admission_shard(grant.table), "finish_grant", grant, accepted))
