"""What the server needs of a storage backend, as a typing.Protocol.

The service, the advantage worker, the metrics and the server's assembly use a backend
only through these methods, so a backend other than the LMDB store (one that spreads a
table over shards, say) plugs in by providing them. `expbuf.server.store.Store` is the
one that exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from expbuf.client import trxp
from expbuf.client.schema.balance import ModelShape
from expbuf.client.trxp.stored.columns import Shares

from .store import (
    Claimed,
    ComputeJob,
    DatasetRecord,
    Entry,
    FailResult,
    IndexBuild,
    MayWait,
    Page,
    Push,
    PutResult,
    RecordPage,
    RolloutGrant,
    Sampled,
    ScrubStatus,
    ShapingUpdate,
    StagedShare,
)
from .store.schema.sample_spec import TakeSpec
from .store.schema.table_config import TableConfig


@runtime_checkable
class Backend(Protocol):
    """Durable tables of experiences: push, sample, leases, admin, upkeep, advantages' I/O."""

    # tables
    def create_table(self, config: TableConfig, *, exist_ok: bool = False) -> bool: ...
    def drop_table(self, name: str) -> int: ...
    def list_tables(self) -> list[TableConfig]: ...
    def has_table(self, name: str) -> bool: ...
    def table(self, name: str) -> TableConfig: ...

    # experiences
    def put(self, table: str, items: Sequence[trxp.RawItem], *, timeout: float | None = None) -> PutResult: ...
    def put_entries(
        self,
        table: str,
        entries: Sequence[Entry],
        *,
        timeout: float | None = None,
        holder: str = "",
        may_wait: MayWait | None = None,
    ) -> PutResult: ...
    def put_in_order(
        self, pushes: Sequence[Push], *, timeout: float | None = None, may_wait: MayWait | None = None
    ) -> Iterator[PutResult]: ...
    def new_chunk_set(self) -> int: ...
    def zstd_level(self, table: str) -> int | None: ...
    def stage(
        self, table: str, set_id: int, index: int, chunk: bytes | memoryview, level: int | None = None
    ) -> Future[None]: ...
    def drop_staged(self, table: str, set_ids: Sequence[int]) -> None: ...
    def open_staged(self, table: str, nbytes: int, timeout: float) -> StagedShare: ...
    def sample(
        self,
        spec: TakeSpec,
        *,
        timeout: float | None = None,
        hold: bool = False,
        owner: str = "",
        stop: Callable[[], bool] | None = None,
        confirm: str | Sequence[str] = "",
    ) -> Sampled | None: ...
    def ack(self, lease_id: str, table: str | None = None, owner: str = "") -> int: ...
    def nack(self, lease_id: str, table: str | None = None, owner: str = "") -> int: ...
    def give_back(self, lease_id: str, table: str, owner: str = "") -> int: ...
    def confirm(self, lease_id: str, spec: TakeSpec, owner: str = "") -> int: ...
    def renew(self, lease_id: str, seconds: float, table: str, owner: str = "") -> tuple[float, int]: ...
    def release_holds(self) -> int: ...
    def get_payload(self, table: str, uids: Sequence[str], limit: int | None = None) -> tuple[bytes, list[str]]: ...
    def get_partials(
        self,
        table: str,
        tids: Sequence[str],
        uids: Sequence[str] = (),
        limit: int = 0,
        *,
        alone: bool = False,
        holder: str = "",
    ) -> tuple[bytes, list[str]]: ...
    def read_fields(
        self, table: str, uids: Sequence[str], shares: Shares | None = None, *, whole: bool = False
    ) -> tuple[Sampled, list[str]]: ...
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
    ) -> list[str]: ...
    def put_values(self, table: str, keys: Sequence[str], values: Sequence[bytes], owner: str = "") -> int: ...
    def get_values(
        self, table: str, keys: Sequence[str], limit: int | None = None, owner: str | None = None
    ) -> list[bytes | None]: ...
    def clear_values(self, table: str, keys: Sequence[str], owner: str = "") -> int: ...
    def quarantine(self, table: str, uids: Sequence[str]) -> int: ...
    def list_experiences(
        self,
        table: str,
        *,
        states: Sequence[str] = (),
        min_version: int | None = None,
        max_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> Page: ...
    def delete(self, table: str, uids: Sequence[str] = (), group_ids: Sequence[str] = ()) -> int: ...
    def retire(self, table: str, group_ids: Sequence[str], owner: str = "") -> int: ...
    def seal(self, table: str, group_id: str, holder: str = "") -> int: ...
    def fail_runs(self, table: str, uids: Sequence[str], reasons: Sequence[str], holder: str = "") -> FailResult: ...
    def set_trainer_version(self, table: str, version: int) -> int: ...
    def reset_offpolicy(self, table: str, version: int | None = None) -> tuple[int | None, int]: ...
    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> RolloutGrant: ...
    def finish_grant(self, table: str, grant_id: str, accepted: int | None = None) -> int: ...

    # the prompt ledger
    def create_dataset(
        self, table: str, ds: DatasetRecord, *, exist_ok: bool = False, stop: Callable[[], bool] | None = None
    ) -> tuple[DatasetRecord, bool]: ...
    def datasets(self, table: str, name: str = "", *, by_epoch: bool = True) -> list[DatasetRecord]: ...
    def claim(
        self,
        table: str,
        name: str,
        count: int,
        *,
        seconds: float,
        owner: str = "",
        holder: str = "",
        wait: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[list[Claimed], bool]: ...
    def renew_claims(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], seconds: float, *, holder: str = ""
    ) -> tuple[float, list[tuple[int, int, int]]]: ...
    def release_claims(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], *, holder: str = ""
    ) -> int: ...
    def report_prompts(
        self, table: str, name: str, outcomes: Sequence[tuple[int, int, int, list[float]]], *, holder: str = ""
    ) -> int: ...
    def list_prompts(
        self,
        table: str,
        name: str,
        *,
        states: Sequence[str] = (),
        after: tuple[int, int] | None = None,
        limit: int = 1000,
    ) -> RecordPage: ...

    # state and upkeep
    def stats(self, table: str) -> dict[str, Any]: ...
    def storage_info(self) -> dict[str, float]: ...
    def scrub_status(self) -> ScrubStatus: ...
    def index_builds(self) -> list[IndexBuild]: ...
    def tick(self) -> dict[str, int]: ...
    def close(self) -> None: ...

    # advantages
    @property
    def generation(self) -> int: ...
    def wait_for_change(self, generation: int, timeout: float) -> bool: ...
    def wake(self) -> None: ...
    def compute_backlog(self, limit: int = 8192) -> list[ComputeJob]: ...
    def finish_compute(
        self,
        table: str,
        advantages: dict[str, float | bytes],
        ready: Sequence[str],
        dropped: Sequence[str] = (),
        failed: dict[str, str] | None = None,
        shaping: ShapingUpdate | None = None,
    ) -> None: ...
