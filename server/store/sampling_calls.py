"""The Store's samples and leases: the façade's calls that its sampling service answers
(services/sampling.py: takes, confirmations, acks, nacks and renewals of leases)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .disk.kinds import Sampled
from .schema.sample_spec import TakeSpec
from .services.sampling import Sampling


class SamplingCalls:
    """Mixed into the Store, which makes `sampling`."""

    sampling: Sampling

    def sample(
        self,
        spec: TakeSpec,
        *,
        timeout: float | None = None,
        hold: bool = False,
        owner: str = "",
        stop: Callable[[], bool] | None = None,
        confirm: str | Sequence[str] = "",
    ) -> Sampled | None:
        """Select whole ready groups; None if not enough arrived within the wait (Sampling.sample)."""
        return self.sampling.sample(spec, timeout=timeout, hold=hold, owner=owner, stop=stop, confirm=confirm)

    def ack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Consume the groups of a lease; returns the experiences acknowledged."""
        return self.sampling.ack(lease_id, table, owner)

    def nack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Return the groups of a lease to the buffer; returns the experiences requeued."""
        return self.sampling.nack(lease_id, table, owner)

    def give_back(self, lease_id: str, table: str, owner: str = "") -> int:
        """A stream's held batch its client did not confirm goes back, uncounted (Sampling.give_back)."""
        return self.sampling.give_back(lease_id, table, owner)

    def confirm(self, lease_id: str, spec: TakeSpec, owner: str = "") -> int:
        """A stream's held batch that its client has, delivered as the stream asked (tables/leases.py)."""
        return self.sampling.confirm(lease_id, spec, owner)

    def renew(self, lease_id: str, seconds: float, table: str, owner: str = "") -> tuple[float, int]:
        """The lease now ends `seconds` from now; returns when, and the experiences it holds."""
        return self.sampling.renew(lease_id, seconds, table, owner)

    def release_holds(self) -> int:
        """Return every batch held for a stream of an earlier run of the server."""
        return self.sampling.release_holds()
