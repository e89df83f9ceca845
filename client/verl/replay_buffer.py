"""ExpbufReplayBuffer: expbuf behind verl V1's `trainer.v1.sampler.custom_sampler`.

mirror (default): verl's agent loop writes TransferQueue as always and verl's own sampling
runs unchanged; a background thread pushes every finished group of the train partition to
expbuf (idempotent: the eid comes from the prompt uid, session and index), retires a group
from expbuf as trained once verl has cleared its keys (after the step that trained it, or
when verl evicted it as stale or filtered), and reports `global_steps` as the table's trainer
version. A retired group's tombstones stay, so the same group pushed again after a restart
from an older checkpoint is a duplicate, not a second copy.
After a restart, the first `sample` reads the groups still in expbuf (pushed, never trained)
and puts those TransferQueue does not already hold back in as finished groups, so verl trains
them instead of losing them. Mirror mode holds no lease: whenever the trainer dies, every
pushed, untrained group is in the table for the next start.

source: groups come from expbuf only (Trinity explorers, other workers). `sample` leases
`batch_size` whole groups within the table's staleness bound of `global_steps`, writes them
into TransferQueue under verl's field names and returns verl's KVBatchMeta; a lease is acked
once verl has cleared all of its keys (after the step that trained them). A lease is short and
renewed while the trainer lives, so a dead trainer's groups go back within one lease.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import defaultdict
from typing import Any

import grpc
import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from expbuf.client import BufferClient, BufferError, FailedPreconditionError, TableInfo
from expbuf.client.kit.batches import take_one
from expbuf.client.kit.lease_keeper import RENEWALS_PER_LEASE, LeaseKeeper
from expbuf.client.kit.retry import retried
from expbuf.client.kit.tables import table_info
from expbuf.client.verl import settings as settings_mod
from expbuf.client.verl.convert import VERL_BATCH, Row, from_verl, parse_key, to_verl
from expbuf.client.verl.rows import put_rows, rows_of

logger = logging.getLogger(__name__)

TRAIN = "train"


class ExpbufReplayBuffer(ReplayBufferAsync):
    """A verl V1 replay buffer whose finished groups are kept (mirror) or taken (source) in expbuf."""

    def __init__(
        self,
        trainer_mode: str,
        trainer_config: Any,
        max_off_policy_threshold: int | None,
        max_off_policy_strategy: str,
        sampler_kwargs: Any,
        refill_fn: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            trainer_mode=trainer_mode,
            trainer_config=trainer_config,
            max_off_policy_threshold=max_off_policy_threshold,
            max_off_policy_strategy=max_off_policy_strategy,
            sampler_kwargs=sampler_kwargs,
            refill_fn=refill_fn,
            **kwargs,
        )
        self.settings = settings_mod.read(sampler_kwargs)
        loc = self.settings.location
        self.table = loc.table
        self.client = BufferClient(loc.target, loc.token, loc.tls)
        self.table_config = self._table_config()
        why = settings_mod.staleness_disagreement(max_off_policy_threshold, self.table_config.max_staleness)
        if why:
            logger.warning(why)
        self.mode = self.settings.mode
        self._lock = threading.Lock()  # the shared state below
        self._round = threading.Lock()  # one background round or restore at a time
        self._pushed: dict[str, set[str]] = {}  # uid -> its TransferQueue keys, for groups expbuf holds
        self._handed: dict[str, int] = {}  # uid -> round it was sampled in, until it is pushed
        self._rounds = 0
        self._source_leases: dict[str, set[str]] = {}  # lease id -> keys written into TransferQueue
        self._version: int | None = None
        self._restore_pending = self.mode == "mirror" and self.settings.restore
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expbuf-verl", daemon=True)
        self._thread.start()
        # the leases of steps still running, renewed every third of a lease while this process lives
        # (its own channel): a dead trainer's groups go back within one lease, a live one's stay
        seconds = self.settings.location.lease_seconds
        renewals = self.client.clone(timeout=seconds / RENEWALS_PER_LEASE)
        self._keeper = LeaseKeeper(self.client, self.table, seconds, renewals=renewals)
        atexit.register(self.close)

    def _table_config(self) -> TableInfo:
        config = table_info(self.client, self.table, make_it="mirror mode: group_by = 'task', group_size = 0")
        if self.settings.mode == "mirror" and (config.group_by != "task" or config.group_size != 0):
            raise ValueError(
                f"expbuf table {self.table!r} has group_by={config.group_by!r}, group_size={config.group_size}: "
                "mirror mode pushes each verl group whole, so the table needs group_by = 'task' and group_size = 0"
            )
        return config

    # ------------------------------------------------------------------ sampling

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        """verl's sampling (mirror, after a restart's restore) or groups leased from expbuf (source);
        validation always samples verl's own way."""
        if partition_id != TRAIN:
            return super().sample(global_steps, partition_id, batch_size)
        self._set_version(global_steps)
        if self.mode == "source":
            return self._lease(global_steps, batch_size), {}
        if self._restore_pending:
            self._restore()
        meta, metrics = super().sample(global_steps, partition_id, batch_size)
        with self._lock:
            for uid in {key.split("_")[0] for key in meta.keys} - self._pushed.keys():
                self._handed[uid] = self._rounds
        return meta, metrics

    def _set_version(self, global_steps: int) -> None:
        with self._lock:
            self._version = global_steps
        self._wake.set()

    def _lease(self, global_steps: int, batch_size: int) -> KVBatchMeta:
        """Lease `batch_size` whole groups within the staleness bound and write them into TransferQueue."""
        staleness = self.table_config.max_staleness
        floor = None if staleness is None else global_steps - staleness
        batch = None
        while batch is None:
            try:
                batch = take_one(
                    self.client,
                    self.table,
                    lambda broken: self._keeper.give_back(broken.lease_id),
                    num_groups=batch_size,
                    retry_for=self.client.timeout,  # a server that restarts is waited for, as Trinity's reader waits
                    delivery="lease",
                    lease_seconds=self.settings.location.lease_seconds,
                    timeout=self.settings.wait_seconds,
                    min_model_version=floor,
                    trainer_version=global_steps,
                )
            except BufferError as exc:
                if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                logger.info("expbuf table %s: waiting for %d groups of version >= %s", self.table, batch_size, floor)
        rows = to_verl(batch.experiences, batch.group_ids)  # one uid a group, whatever the table groups by
        for row in rows:
            _stamp(row, global_steps)
        put_rows(TRAIN, rows)
        keys = [row.key for row in rows]
        with self._lock:
            self._source_leases[batch.lease_id] = set(keys)
        self._keeper.hold(batch.lease_id, batch.lease_expires)
        return KVBatchMeta(partition_id=TRAIN, keys=keys, tags=[row.tag for row in rows])

    # ------------------------------------------------------------------ restore

    def _restore(self) -> None:
        """Put the groups expbuf still holds (pushed, never trained) back into TransferQueue."""
        self._restore_pending = False
        with self._round:
            self._restore_groups()

    def _restore_groups(self) -> None:
        """Every group a mirror table holds was pushed and never trained: ready, or leased by a trainer
        that died under an older release (the table is its trainer's alone). They are read, not
        leased, so a crash at any point of the restore or after it leaves them for the next start."""
        groups = self._held_groups()
        if not groups:
            return
        listing = (tq.kv_list(TRAIN) or {}).get(TRAIN, {})
        present = _trajectories(listing)
        restored = 0
        for group_id, uids in groups.items():
            rows = to_verl(self.client.get(uids, self.table))
            uid = rows[0].key.split("_")[0]
            if uid in present and uid not in listing:
                # Trained: verl saves its checkpoint after a step and clears the step's keys after that,
                # so the checkpoint holds them without their prompt. verl never samples them again.
                self._retire(group_id)
                continue
            if uid not in present:  # TransferQueue's own checkpoint did not bring it back
                put_rows(TRAIN, rows)
                steps = rows[0].tag.get("global_steps")
                tag = {"is_prompt": True, "status": "finished", "global_steps": steps}
                tq.kv_batch_put(keys=[uid], partition_id=TRAIN, tags=[tag])
                restored += 1
            with self._lock:
                self._pushed[uid] = present.get(uid) or {row.key for row in rows}
        logger.warning("expbuf table %s: put %d untrained groups back into TransferQueue", self.table, restored)

    def _held_groups(self) -> dict[str, list[str]]:
        """Group id -> its members' uids, of every live group of the table, in the order they were pushed."""
        groups: dict[str, list[str]] = defaultdict(list)
        page = self.client.list_experiences(self.table)
        while True:
            for listed in page.experiences:
                groups[listed.group_id].append(listed.uid)
            if page.done:
                return groups
            page = self.client.list_experiences(self.table, after=page.next)

    # ------------------------------------------------------------------ background

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self.poll_interval)
            self._wake.clear()
            try:
                self.sync_once()
            except Exception:
                logger.exception("expbuf table %s: mirror round failed; retrying", self.table)

    def sync_once(self) -> None:
        """One background round: report the version, push finished groups, retire trained ones."""
        with self._round:
            self._sync()

    def _sync(self) -> None:
        with self._lock:
            version = self._version
            self._rounds += 1
        if version is not None:
            self.client.set_trainer_version(version, self.table)
            with self._lock:  # reported; a newer version set meanwhile waits for the next round
                if self._version == version:
                    self._version = None
        listing = (tq.kv_list(TRAIN) or {}).get(TRAIN, {})
        if self.mode == "mirror":
            self._push_finished(listing)
            self._retire_trained(listing)
        else:
            self._ack_cleared(listing)

    def _push_finished(self, listing: dict[str, dict]) -> None:
        """Push each group that is finished, or that this process handed to the trainer (its prompt
        key gone). Keys without a prompt that this process never handed out are a trained step's,
        brought back by verl's checkpoint: they are not pushed."""
        trajectories = _trajectories(listing)
        for uid, keys in sorted(trajectories.items()):
            with self._lock:
                known, handed = uid in self._pushed, uid in self._handed
            finished = listing[uid].get("status") == "finished" if uid in listing else handed
            if known or not finished:
                continue
            self._push_group(uid, rows_of(TRAIN, sorted(keys), listing))
            with self._lock:
                self._pushed[uid] = keys
                self._handed.pop(uid, None)
        with self._lock:  # sampled before this round's listing and gone from it: trained before it was pushed
            for uid in [u for u, n in self._handed.items() if n < self._rounds and u not in trajectories]:
                del self._handed[uid]

    def _push_group(self, uid: str, rows: list[Row]) -> None:
        """Push one group; one that can never be stored is logged and left to verl alone, so it does not
        hold back the others (a server that cannot be reached fails the round, which is retried)."""
        try:
            result = self.client.push(from_verl(rows), self.table)
        except (ValueError, BufferError) as exc:
            code = getattr(exc, "code", None)
            if code not in (None, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
                raise
            logger.error("expbuf table %s: group %s is not mirrored: %s", self.table, uid, exc)
            return
        if result.stale:
            logger.warning("expbuf table %s: %d experiences of %s were stale", self.table, len(result.stale), uid)

    def _retire_trained(self, listing: dict[str, dict]) -> None:
        """A group leaves expbuf once verl has cleared its keys (trained, or evicted as stale or filtered)."""
        with self._lock:
            done = [uid for uid, keys in self._pushed.items() if not keys & listing.keys()]
        for uid in done:
            if not self._retire(f"{VERL_BATCH}/{uid}"):
                continue
            with self._lock:
                self._pushed.pop(uid, None)

    def _retire(self, group_id: str) -> bool:
        """Retire a group as trained: its payloads go, its tombstones stay (a push of it again is a
        duplicate). False while the table still computes its advantages: the next round retires it."""
        try:
            self.client.retire([group_id], self.table)
        except FailedPreconditionError as exc:
            logger.info("expbuf table %s: group %s retires once complete (%s)", self.table, group_id, exc.details)
            return False
        return True

    def _ack_cleared(self, listing: dict[str, dict]) -> None:
        """Ack each lease whose keys verl has cleared; one that ended first is said, not retried, so
        it holds back neither the round nor the other leases."""
        with self._lock:
            done = [lease for lease, keys in self._source_leases.items() if not keys & listing.keys()]
        for lease in done:
            self._keeper.ack(lease)
            with self._lock:
                self._source_leases.pop(lease, None)

    def _give_back(self) -> None:
        """At close, the leases of steps that never ended go back to the table now."""
        with self._lock:
            leases = list(self._source_leases)
            self._source_leases.clear()
        for lease in leases:
            self._keeper.give_back(lease)

    def close(self) -> None:
        """Finish the pending round (pushes, retirements, acks), give back the leases of steps that
        never ended and stop the background threads."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=30)
        try:  # while the server restarts, for the client's timeout: its acks are of trained steps
            retried(self.sync_once, self.client.timeout)
        except Exception:
            logger.exception("expbuf table %s: last mirror round failed", self.table)
        self._give_back()
        self._keeper.close()
        self.client.close()


def _trajectories(listing: dict[str, dict]) -> dict[str, set[str]]:
    """uid -> its trajectory keys, from a `kv_list` listing of a partition."""
    keys: dict[str, set[str]] = defaultdict(set)
    for key, tag in listing.items():
        if not tag.get("is_prompt"):
            keys[key.split("_")[0]].add(key)
    return keys


def _stamp(row: Row, global_steps: int) -> None:
    """Policy-version tags verl's metrics read: an experience of unknown version counts as the last one."""
    previous = global_steps - 1
    for name in ("min_global_steps", "max_global_steps", "global_steps"):
        if row.tag.get(name) is None:
            row.tag[name] = previous
    row.fields.setdefault("global_steps", row.tag["global_steps"])
    uid, _, _ = parse_key(row.key)
    row.fields["uid"] = uid
