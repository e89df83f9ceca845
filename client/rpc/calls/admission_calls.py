"""The off-policy bound as the clients keep it (AdmissionCalls, declared once: rpc/declare.py): the
trainer's policy version a table measures staleness from, its reset for a job that starts over,
and rollouts admitted under the table's staleness bound and their grants finished."""

from __future__ import annotations

import uuid

from expbuf.proto.v1 import buffer_pb2 as pb

from ...results import Grant
from ..declare import ClientSettings, Plan, Unary, declare, waited


def new_grant_id() -> str:
    """A name for a grant that no other admit makes (admit's `grant_id`)."""
    return uuid.uuid4().hex


def _version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    return version


class AdmissionCalls(ClientSettings):
    """The calls of trainer versions and admission, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: s._set_trainer_version)
    def set_trainer_version(self, version: int, table: str = "default") -> Plan[int]:
        """Tell the table the trainer's current policy version (staleness is measured from it).
        Returns the version stored: it only moves forward, so a lower one keeps the table's.

        Sharded: on every shard, the lowest version a shard holds; a shard that does not answer
        is owed the version, sent the next time it answers (`pending`)."""
        request = pb.SetTrainerVersionRequest(table=table, version=_version(version))
        return Unary("SetTrainerVersion", request, lambda r: r.version, retry=True)

    @declare(shards=lambda s: s._reset_offpolicy)
    def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> Plan[dict[str, int]]:
        """Admin: reset the table's off-policy state for a job that starts over: the trainer
        version becomes `trainer_version` (None: unset), backwards too, and admission counts
        only the rollouts of grants still open. Returns both (trainer_version -1 = unset).
        Sharded: on every shard, each shard's answer by its name."""
        request = pb.ResetOffPolicyRequest(table=table)
        if trainer_version is not None:
            request.trainer_version, request.has_trainer_version = _version(trainer_version), True
        return Unary(
            "ResetOffPolicy",
            request,
            lambda r: {"trainer_version": r.trainer_version, "submitted": r.submitted},
            retry=True,
        )

    @declare(shards=lambda s: s._admit)
    def admit(
        self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0, grant_id: str | None = None
    ) -> Plan[Grant]:
        """How many of `count` rollouts may start now under the table's staleness bound,
        waiting up to `wait` seconds for room (asking again while the server has as many admits
        waiting as it lets, as claim does). Finish the grant when the rollouts are done
        (`finish_grant`); a grant not finished within grant_seconds gives its room back.
        `grant_id` names the grant (None: a new name, `new_grant_id`): the admit made again with
        it while that grant is open answers that grant, not a second one, so the client makes it
        again itself while the server is unavailable, as a caller may across a restart.
        Sharded: on the table's admission shard (`admission_shard`)."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        wait = waited("admit", wait)
        request = pb.AdmitRequest(
            table=table,
            count=count,
            wait_seconds=wait,
            grant_seconds=grant_seconds,
            grant_id=grant_id or new_grant_id(),
        )
        return Unary(
            "Admit",
            request,
            lambda r: Grant(r.granted, r.grant_id, r.expires_unix, table),
            retry=True,
            timeout=wait + self.timeout,
            remembered=True,
        )

    @declare(shards=lambda s: s._finish_grant)
    def finish_grant(self, grant: Grant, accepted: int | None = None) -> Plan[int]:
        """End a grant: `accepted` rollouts (None: all) stay counted; the others' room comes back.
        Made again after its reply was lost, it answers as the first did (the server remembers the
        grants it saw end, for its run); NotFoundError for a grant that expired first, saying so.
        Sharded: on the shard that granted it."""
        request = pb.FinishGrantRequest(table=grant.table, grant_id=grant.grant_id, accepted=accepted)
        return Unary("FinishGrant", request, lambda r: r.returned, retry=True, remembered=True)
