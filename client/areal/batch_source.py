"""ExpbufBatchSource: AReaL's trainer takes its batches from an expbuf table, filled elsewhere.

It answers `prepare_batch` as AReaL's inference engine does (the trainer calls it with the
same arguments): one right-padded trajectory dict per group, `dataloader.batch_size` groups,
ready for AReaL's trajectory format check and `concat_padded_tensors`. Groups are taken under a
lease with `min_model_version = version - max_head_offpolicyness` and the trainer's version,
which the table stores; the lease is renewed while the trainer works on the batch and acked at
the next `prepare_batch` (the trainer is done with it), so a step of any length keeps its groups
and a trainer that crashes mid-step loses nothing: the groups come back within a lease.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..client import Batch, BufferClient
from ..kit.batches import take_one
from ..kit.lease_keeper import RENEWALS_PER_LEASE, LeaseKeeper
from ..kit.retry import retried
from ..kit.tables import close_made, connect, table_info
from ..schema.routing import GROUP_KEY_OF
from .convert import to_areal


class ExpbufBatchSource:
    """What AReaL's trainer calls `prepare_batch` on (its rollout engine's place).

    `version_provider` (the actor engine, say) has `get_version()`; without one, the version is
    the last given to `set_version`, which AReaL's trainer calls on the rollout engine after each
    weight update, and which sets the table's trainer version there and then.
    With `advantages`, each dict also has the table's `advantages`, with AReaL's next-token
    shift (see `keep_expbuf_advantages` to have AReaL's actor train on them)."""

    def __init__(
        self,
        client: BufferClient | str,
        table: str,
        *,
        max_head_offpolicyness: int,
        version_provider: Any = None,
        advantages: bool = False,
        lease_seconds: float = 1800.0,
        timeout: float = 600.0,
        token: str | None = None,
    ) -> None:
        self.client = connect(client, token)
        self._given = client
        self.table = table
        self.max_head_offpolicyness = max_head_offpolicyness
        self.version_provider = version_provider
        self.advantages = advantages
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        self._group_key = GROUP_KEY_OF.get(table_info(self.client, table).group_by, "uid")
        self._version = 0
        self._held: Batch | None = None
        self._trained = False  # the held batch was trained on: its ack failed, and is made again
        renewals = self.client.clone(timeout=lease_seconds / RENEWALS_PER_LEASE)
        self._keeper = LeaseKeeper(self.client, table, lease_seconds, renewals=renewals)
        weakref.finalize(self, self._keeper.close)  # a source dropped unclosed renews nothing more

    def get_version(self) -> int:
        """The trainer's version: the version provider's, or else the last given to set_version."""
        return self.version_provider.get_version() if self.version_provider is not None else self._version

    def set_version(self, version: int) -> None:
        """The trainer's new version (AReaL's trainer calls this on its rollout engine after each
        weight update): kept, and told to the table at once, whose admission and staleness bound
        the rollout processes follow, rather than at the next prepare_batch."""
        retried(lambda: self.client.set_trainer_version(version, self.table), self.client.timeout)  # a restart
        self._version = version

    def ack(self) -> None:
        """The trainer is done with the last batch: its groups leave the table. The ack is made
        again while the server is unavailable, for the client's timeout (a restart); where it still
        fails it raises, and the batch stays held, its lease renewed, to be acked at the next
        prepare_batch or at close(): a trained batch is never served again."""
        held = self._held
        if held is not None:
            self._trained = True
            self._keeper.ack(held.lease_id, retry_for=self.client.timeout)
            self._held, self._trained = None, False

    def close(self) -> None:
        """Stop renewing. The batch held goes back now where no step is known to have trained it,
        and is acked where one did (its ack failed before). A client made from a target string is
        closed; one given stays open."""
        held, self._held = self._held, None
        try:
            if held is not None and self._trained:
                self._keeper.ack(held.lease_id, retry_for=self.client.timeout, tried=True)
            elif held is not None:
                self._keeper.give_back(held.lease_id)
        finally:
            self._keeper.close()
            close_made(self._given, self.client)

    def prepare_batch(
        self,
        dataloader: Any = None,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Any = None,
        group_size: int = 1,
        dynamic_bs: bool = False,
        *,
        num_groups: int | None = None,
    ) -> list[dict[str, Any]]:
        """`num_groups` (default: dataloader.batch_size) whole groups, one AReaL dict each.
        The workflow arguments are AReaL's and are not used: the groups were made elsewhere."""
        count = num_groups or getattr(dataloader, "batch_size", None)
        if not count:
            raise ValueError("prepare_batch needs num_groups or a dataloader with a batch_size")
        self.ack()
        version = self.get_version()
        batch = take_one(
            self.client,
            self.table,
            lambda broken: self._keeper.give_back(broken.lease_id),
            num_groups=count,
            retry_for=self.client.timeout,  # a server that restarts is waited for, as Trinity-RFT's reader waits
            delivery="lease",
            lease_seconds=self.lease_seconds,
            timeout=self.timeout,
            min_model_version=max(0, version - self.max_head_offpolicyness),
            trainer_version=version,
        )
        if batch is None:  # not allow_partial: a stream ends with its batch or an error
            raise RuntimeError(f"expbuf table {self.table}: a sample stream ended without its batch")
        self._keeper.hold(batch.lease_id, batch.lease_expires)
        self._held = batch
        groups: dict[str, list[Any]] = {}
        for exp in batch.experiences:
            groups.setdefault(getattr(exp.eid, self._group_key), []).append(exp)
        return [
            to_areal(sorted(g, key=lambda e: (e.eid.run, e.eid.step)), advantages=self.advantages)
            for g in groups.values()
        ]
