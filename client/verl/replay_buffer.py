"""ExpbufReplayBuffer: expbuf behind verl V1's `trainer.v1.sampler.custom_sampler`.

mirror (default): verl's agent loop writes TransferQueue as always and verl's own sampling
runs unchanged; a background thread pushes every finished group of the train partition to
expbuf (idempotent: the eid comes from the prompt uid, session and index), deletes a group
from expbuf once verl has cleared its keys after the step that trained it, and reports
`global_steps` as the table's trainer version. After a restart, the first `sample` leases the
groups still in expbuf (pushed, never trained) and puts those TransferQueue does not already
hold back in as finished groups, so verl trains them instead of losing them.

source: groups come from expbuf only (Trinity explorers, other workers). `sample` leases
`batch_size` whole groups within the table's staleness bound of `global_steps`, writes them
into TransferQueue under verl's field names and returns verl's KVBatchMeta; a lease is acked
once verl has cleared all of its keys (after the step that trained them).
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

from expbuf.client import BufferClient, BufferError
from expbuf.client.verl import settings as settings_mod
from expbuf.client.verl.convert import Row, from_verl, parse_key, to_verl
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
        why = settings_mod.staleness_disagreement(max_off_policy_threshold, self.table_config.get("max_staleness"))
        if why:
            logger.warning(why)
        self.mode = self.settings.mode
        self._lock = threading.Lock()
        self._pushed: set[str] = set()  # uids of groups expbuf holds (pushed or restored)
        self._wanted: set[str] = set()  # uids handed to the trainer before the mirror saw them finished
        self._handed: dict[str, set[str]] = {}  # uid -> its keys handed to the trainer (mirror)
        self._restored_leases: dict[str, str] = {}  # uid -> lease holding it since a restart
        self._source_leases: dict[str, set[str]] = {}  # lease id -> keys written into TransferQueue
        self._version: int | None = None
        self._restore_pending = self.mode == "mirror" and self.settings.restore
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expbuf-verl", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _table_config(self) -> dict[str, Any]:
        tables = {t["name"]: t for t in self.client.list_tables()}
        if self.table not in tables:
            raise ValueError(
                f"expbuf table {self.table!r} does not exist on {self.client.target}: create it "
                "(TOML [[tables]] or create_table; mirror mode: group_by = 'task', group_size = 0)"
            )
        config = tables[self.table]
        if self.settings.mode == "mirror" and (config["group_by"] != "task" or config["group_size"] != 0):
            raise ValueError(
                f"expbuf table {self.table!r} has group_by={config['group_by']!r}, group_size={config['group_size']}: "
                "mirror mode pushes each verl group whole, so the table needs group_by = 'task' and group_size = 0"
            )
        return config

    # ------------------------------------------------------------------ sampling

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if partition_id != TRAIN:
            return super().sample(global_steps, partition_id, batch_size)
        self._set_version(global_steps)
        if self.mode == "source":
            return self._lease(global_steps, batch_size), {}
        if self._restore_pending:
            self._restore()
        meta, metrics = super().sample(global_steps, partition_id, batch_size)
        with self._lock:
            for key in meta.keys:
                uid = key.split("_")[0]
                self._handed.setdefault(uid, set()).add(key)
                if uid not in self._pushed:
                    self._wanted.add(uid)
        self._wake.set()
        return meta, metrics

    def _set_version(self, global_steps: int) -> None:
        with self._lock:
            self._version = global_steps
        self._wake.set()

    def _lease(self, global_steps: int, batch_size: int) -> KVBatchMeta:
        """Lease `batch_size` whole groups within the staleness bound and write them into TransferQueue."""
        staleness = self.table_config.get("max_staleness")
        floor = None if staleness is None else global_steps - staleness
        while True:
            try:
                batch = next(
                    self.client.sample(
                        self.table,
                        num_groups=batch_size,
                        delivery="lease",
                        lease_seconds=self.settings.location.lease_seconds,
                        timeout=self.settings.wait_seconds,
                        max_batches=1,
                        min_model_version=floor,
                        trainer_version=global_steps,
                    )
                )
                break
            except BufferError as exc:
                if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                logger.info("expbuf table %s: waiting for %d groups of version >= %s", self.table, batch_size, floor)
        rows = to_verl(batch.experiences)
        for row in rows:
            _stamp(row, global_steps)
        put_rows(TRAIN, rows)
        keys = [row.key for row in rows]
        with self._lock:
            self._source_leases[batch.lease_id] = set(keys)
        return KVBatchMeta(partition_id=TRAIN, keys=keys, tags=[row.tag for row in rows])

    # ------------------------------------------------------------------ restore

    def _restore(self) -> None:
        """Put the groups expbuf still holds (pushed, never trained) back into TransferQueue."""
        self._restore_pending = False
        ready = int(self.client.stats(self.table)[self.table]["groups_ready"])
        if not ready:
            return
        present = {key.split("_")[0] for key in (tq.kv_list(TRAIN) or {}).get(TRAIN, {})}
        restored = 0
        for batch in self.client.sample(
            self.table,
            num_groups=1,
            delivery="lease",
            lease_seconds=self.settings.location.lease_seconds,
            timeout=self.settings.wait_seconds,
            max_batches=ready,
        ):
            rows = to_verl(batch.experiences)
            uid = rows[0].key.split("_")[0]
            with self._lock:
                self._pushed.add(uid)
                self._restored_leases[uid] = batch.lease_id
            if uid in present:  # TransferQueue's own checkpoint brought it back
                continue
            put_rows(TRAIN, rows)
            steps = rows[0].tag.get("global_steps")
            tq.kv_batch_put(
                keys=[uid], partition_id=TRAIN, tags=[{"is_prompt": True, "status": "finished", "global_steps": steps}]
            )
            restored += 1
        logger.warning("expbuf table %s: put %d untrained groups back into TransferQueue", self.table, restored)

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
        with self._lock:
            version, self._version = self._version, None
        if version is not None:
            self.client.set_trainer_version(version, self.table)
        listing = (tq.kv_list(TRAIN) or {}).get(TRAIN, {})
        if self.mode == "mirror":
            self._push_finished(listing)
            self._retire_trained(listing)
        else:
            self._ack_cleared(listing)

    def _push_finished(self, listing: dict[str, dict]) -> None:
        keys_of: dict[str, list[str]] = defaultdict(list)
        finished: set[str] = set()
        for key, tag in listing.items():
            if tag.get("is_prompt"):
                if tag.get("status") == "finished":
                    finished.add(key)
            else:
                keys_of[key.split("_")[0]].append(key)
        with self._lock:
            todo = sorted((finished | self._wanted) - self._pushed)
            self._wanted.clear()
        for uid in todo:
            keys = sorted(keys_of.get(uid, ()))
            if not keys:  # trained and cleared before this round saw it
                continue
            rows = rows_of(TRAIN, keys, listing)
            result = self.client.push(from_verl(rows), self.table)
            if result.stale:
                logger.warning("expbuf table %s: %d experiences of %s were stale", self.table, len(result.stale), uid)
            with self._lock:
                self._pushed.add(uid)

    def _retire_trained(self, listing: dict[str, dict]) -> None:
        with self._lock:
            done = [uid for uid, keys in self._handed.items() if not keys & listing.keys()]
        for uid in done:
            lease = self._restored_leases.get(uid)
            if lease is not None:
                self.client.ack(lease, self.table)
            else:
                self.client.delete(table=self.table, groups=[f"verl/{uid}"])
            with self._lock:
                self._handed.pop(uid, None)
                self._restored_leases.pop(uid, None)
                self._pushed.discard(uid)

    def _ack_cleared(self, listing: dict[str, dict]) -> None:
        with self._lock:
            done = [lease for lease, keys in self._source_leases.items() if not keys & listing.keys()]
        for lease in done:
            self.client.ack(lease, self.table)
            with self._lock:
                self._source_leases.pop(lease, None)

    def close(self) -> None:
        """Finish the pending round (pushes, retirements, acks) and stop the background thread."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=30)
        try:
            self.sync_once()
        except Exception:
            logger.exception("expbuf table %s: last mirror round failed", self.table)
        self.client.close()


def _stamp(row: Row, global_steps: int) -> None:
    """Policy-version tags verl's metrics read: an experience of unknown version counts as the last one."""
    previous = global_steps - 1
    for name in ("min_global_steps", "max_global_steps", "global_steps"):
        if row.tag.get(name) is None:
            row.tag[name] = previous
    row.fields.setdefault("global_steps", row.tag["global_steps"])
    uid, _, _ = parse_key(row.key)
    row.fields["uid"] = uid
