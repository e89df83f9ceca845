"""The Store's reads of named experiences (Get, ReadFields and a rank's part of a lease,
ListExperiences) and its keyed values: the façade's calls that its reads service
(services/reads.py) and its values service (services/values.py) answer."""

from __future__ import annotations

from collections.abc import Sequence

from expbuf.client.schema.balance import ModelShape
from expbuf.client.trxp.stored.columns import Shares

from .core import reading
from .disk.kinds import Sampled
from .services.reads import Reads
from .services.values import Values


class ReadCalls:
    """Mixed into the Store, which makes `reads` and `values`."""

    reads: Reads
    values: Values

    def get(self, table: str, uids: Sequence[str]) -> dict[str, bytes]:
        """Stored payloads among uids, each checked first (Reads.get)."""
        return self.reads.get(table, uids)

    def list_experiences(
        self,
        table: str,
        *,
        states: Sequence[str] = (),
        min_version: int | None = None,
        max_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> reading.Page:
        """A page of the table's live experiences in insertion order (core/reading.py)."""
        return self.reads.page(
            table, states=states, min_version=min_version, max_version=max_version, after=after, limit=limit
        )

    def get_payload(self, table: str, uids: Sequence[str], limit: int | None = None) -> tuple[bytes, list[str]]:
        """A TRXP batch of the servable experiences among uids, and the missing uids (Reads.payload);
        TooLarge past `limit` bytes."""
        return self.reads.payload(table, uids, limit)

    def get_partials(
        self,
        table: str,
        tids: Sequence[str],
        uids: Sequence[str] = (),
        limit: int = 0,
        *,
        alone: bool = False,
        holder: str = "",
    ) -> tuple[bytes, list[str]]:
        """A TRXP batch of the rollouts of tasks `tids` and of `uids` held in pieces, as they stand,
        within `limit` bytes (0: all; `alone`: the first whatever its size), and those left out;
        `holder` is who reads, a prompt's only while it holds the prompt's claim (Reads.partials)."""
        return self.reads.partials(table, tids, uids, limit, alone=alone, holder=holder)

    def read_fields(
        self, table: str, uids: Sequence[str], shares: Shares | None = None, *, whole: bool = False
    ) -> tuple[Sampled, list[str]]:
        """The servable experiences among uids as a batch to read some fields of, or `whole`, and
        the missing uids (Reads.fields); release the batch once its reply is built."""
        return self.reads.fields(table, uids, shares, whole=whole)

    def lease_part(
        self,
        table: str,
        lease_id: str,
        rank: int,
        ranks: int,
        balance: str,
        model: ModelShape | None = None,
        owner: str = "",
        equal: bool = False,
    ) -> list[str]:
        """The uids of one rank's part of a leased batch spread over `ranks` ranks (Reads.part)."""
        return self.reads.part(table, lease_id, rank, ranks, balance, model, owner, equal)

    def put_values(self, table: str, keys: Sequence[str], values: Sequence[bytes], owner: str = "") -> int:
        """Store keyed values, durable on return, as `owner`'s (services/values.py); how many."""
        return self.values.put(table, keys, values, owner)

    def get_values(
        self, table: str, keys: Sequence[str], limit: int | None = None, owner: str | None = None
    ) -> list[bytes | None]:
        """The value of each key, None for one not stored; TooLarge past `limit` bytes; with an
        `owner`, Forbidden for another's."""
        return self.values.get(table, keys, limit, owner)

    def clear_values(self, table: str, keys: Sequence[str], owner: str = "") -> int:
        """Remove keyed values (none of another owner's); how many were stored."""
        return self.values.clear(table, keys, owner)
