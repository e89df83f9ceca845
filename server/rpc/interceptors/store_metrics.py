"""The store's metrics, read from it at every scrape (`StoreCollector`): what it keeps durably
(counts by state, totals pushed, sampled, evicted, dropped, expired, the prompt ledger's counts),
so gauges and counters stay right across restarts. Tables that never held anything, but
`default`, are left out of the per-table series (`expbuf_tables` counts all tables)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...advantages.moments import RunningMoments
from ...store import LIVE, PASS_BANDS, PROMPT_STATES, DatasetRecord, IndexBuild, ScrubStatus, Store
from ...store.schema.errors import NotFound

GROUP_STATES = LIVE
EXPERIENCE_STATES = (*LIVE, "consumed", "quarantined")
_STORE_COUNTERS = (
    ("expbuf_experiences_pushed", "Experiences stored (not counting duplicates).", "pushed"),
    ("expbuf_experiences_sampled", "Experiences delivered in sampled batches.", "sampled"),
    ("expbuf_bytes_pushed", "Bytes of experiences stored.", "bytes_pushed"),
    ("expbuf_bytes_sampled", "Bytes of experiences delivered in sampled batches.", "bytes_sampled"),
    ("expbuf_duplicates", "Pushed experiences that were already stored with identical bytes.", "duplicates"),
    ("expbuf_leases_expired", "Leases that expired and returned their groups.", "leases_expired"),
    ("expbuf_evicted", "Experiences evicted to make room.", "evicted_total"),
    ("expbuf_groups_failed", "Groups failed: advantages not computed, or a member found damaged.", "groups_failed"),
    ("expbuf_rollouts_admitted", "Rollouts granted by Admit.", "admitted"),
    ("expbuf_rollouts_expired", "Granted rollouts given back by grants that expired.", "grants_expired"),
    ("expbuf_stale_dropped", "Pushed experiences dropped as staler than max_staleness.", "stale_dropped"),
    ("expbuf_runs_failed", "Runs their workers reported failed (FailRuns).", "runs_failed"),
    (
        "expbuf_groups_timed_out",
        "Incomplete groups their timeout ended: released short, dropped, or dropped as too short.",
        "groups_timed_out",
    ),
    ("expbuf_groups_short", "Groups complete with fewer members than group_size.", "groups_short"),
    ("expbuf_pieces_pushed", "Pieces of partial rollouts stored.", "pieces_pushed"),
    (
        "expbuf_tokens_masked",
        "Sampled tokens masked out of the action mask as staler than max_token_staleness.",
        "tokens_masked",
    ),
    (
        "expbuf_damaged",
        "Experiences found damaged on disk by a read or the scrub, and quarantined: never served, their groups failed; "
        "and rollouts held in pieces found with a piece lost or damaged, their pieces dropped.",
        "damaged",
    ),
)
_DROP_REASONS = ("zero_variance", "timeout", "std_threshold", "stale", "short", "claim_ended")
_CLIP_STEPS = ("reward", "advantage")  # the shaping steps that clip: counters {step}s_seen and {step}s_clipped


class StoreCollector(Collector):
    """Reads the store's durable counters and states at scrape time."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        names = [t.name for t in self.store.list_tables()]
        yield _tables(len(names))
        # A table that never held anything has only zeros to export: left out, so that a
        # scrape's size and cost grow with the tables in use, not with all tables. The default
        # table always is exported, so that every server has its series (a dashboard's list of
        # shards is read from them).
        tables = {
            name: stats for name in names if (stats := self._stats(name)) and (any(stats.values()) or name == "default")
        }
        yield from self._families(
            tables,
            self.store.scrub_status(),
            self.store.index_builds(),
            {name: self._datasets(name) for name in names},
            self.store.storage_info(),
        )

    def describe(self) -> Iterator[Metric]:
        """The families `collect` yields, without its samples and reading nothing: the registry
        learns their names from it, and a scrape that names the metrics it wants (`?name[]=`)
        found none of the store's."""
        yield _tables(0)
        yield from self._families({}, ScrubStatus(), [], {}, collections.defaultdict(int))

    def _families(
        self,
        tables: dict[str, dict[str, Any]],
        scrub: ScrubStatus,
        builds: list[IndexBuild],
        datasets: dict[str, list[DatasetRecord]],
        storage: Mapping[str, Any],
    ) -> Iterator[Metric]:
        """The store's metrics but the count of its tables: of the tables' stats (`tables`: those
        exported), its scrub, index builds, datasets and storage."""
        experiences = GaugeMetricFamily("expbuf_buffer_experiences", "Experiences by state.", labels=["table", "state"])
        groups = GaugeMetricFamily("expbuf_groups", "Groups by state.", labels=["table", "state"])
        for table, stats in tables.items():
            for state in EXPERIENCE_STATES:
                experiences.add_metric([table, state], stats[state])
            for state in GROUP_STATES:
                groups.add_metric([table, state], stats[f"groups_{state}"])
            groups.add_metric([table, "failed"], stats["groups_failed"])  # deprecated: expbuf_groups_failed_total
        yield experiences
        yield groups
        for name, text, key in _STORE_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["table"])
            for table, stats in tables.items():
                family.add_metric([table], stats[key])
            yield family
        dropped = CounterMetricFamily("expbuf_groups_dropped", "Groups dropped, by reason.", labels=["table", "reason"])
        for table, stats in tables.items():
            for reason in _DROP_REASONS:
                dropped.add_metric([table, reason], stats[f"dropped_{reason}"])
        yield dropped
        yield from _shaping_metrics(tables)
        trainer = GaugeMetricFamily(
            "expbuf_trainer_version", "The trainer's policy version (tables where it was set).", labels=["table"]
        )
        for table, stats in tables.items():
            if stats["trainer_version"] is not None:
                trainer.add_metric([table], stats["trainer_version"])
        yield trainer
        blocked = CounterMetricFamily(
            "expbuf_rate_limit_blocked_seconds",
            "Seconds the rate limits held inserts and samples (those that passed or timed out).",
            labels=["table", "side"],
        )
        for table, stats in tables.items():
            for side in ("insert", "sample"):
                blocked.add_metric([table, side], stats[f"{side}_blocked_seconds"])
        yield blocked
        gauges = (
            ("expbuf_partials", "Rollouts held in pieces, not finished yet.", "partials"),
            ("expbuf_values", "Keyed values (PutValues) the table holds.", "values"),
            ("expbuf_value_bytes", "Bytes of keyed values, each key's and value's (in capacity_bytes).", "value_bytes"),
            ("expbuf_staged_bytes", "Bytes pushes in chunks in progress staged, not yet stored.", "staged_bytes"),
        )
        for name, text, key in gauges:
            gauge = GaugeMetricFamily(name, text, labels=["table"])
            for table, stats in tables.items():
                gauge.add_metric([table], stats[key])
            yield gauge
        oldest = GaugeMetricFamily("expbuf_oldest_age_seconds", "Age of the oldest live experience.", labels=["table"])
        for table, stats in tables.items():
            oldest.add_metric([table], stats["oldest_age_seconds"])
        yield oldest
        yield from _scrub_metrics(scrub)
        yield from _build_metrics(builds)
        yield from _ledger_metrics(datasets)
        yield GaugeMetricFamily(
            "expbuf_storage_bytes",
            "Bytes of the LMDB data file's pages in use (what consumes free is room again).",
            value=storage["in_use_bytes"],
        )
        yield GaugeMetricFamily(
            "expbuf_storage_file_bytes",
            "Bytes of the LMDB data file up to its last page: its high-water mark.",
            value=storage["used_bytes"],
        )
        yield GaugeMetricFamily(
            "expbuf_lmdb_map_used_ratio", "Used part of the LMDB map.", value=storage["map_used_ratio"]
        )
        room = (
            ("expbuf_lmdb_map_max_bytes", "The most the LMDB map may grow to (max_map_size).", "max_map_size"),
            ("expbuf_disk_size_bytes", "Size of the data directory's disk (-1: unreadable).", "disk_bytes"),
            ("expbuf_disk_free_bytes", "Free bytes on the data directory's disk (-1: unreadable).", "disk_free_bytes"),
        )
        for name, text, key in room:
            yield GaugeMetricFamily(name, text, value=storage[key])
        shared = (
            ("expbuf_shared_prompts", "Prompts stored once for the runs that share them.", "shared_prompts"),
            ("expbuf_shared_prompt_bytes", "Bytes of the pages the shared prompts take.", "shared_prompt_bytes"),
        )
        for name, text, key in shared:
            yield GaugeMetricFamily(name, text, value=storage[key])

    def _stats(self, table: str) -> dict[str, Any] | None:
        """A listed table's stats; None where it was dropped since the scrape listed it."""
        try:
            return self.store.stats(table)
        except NotFound:
            return None

    def _datasets(self, table: str) -> list[DatasetRecord]:
        """A listed table's datasets; none where it was dropped since the scrape listed it."""
        try:
            return self.store.datasets(table, by_epoch=False)
        except NotFound:
            return []


def _tables(count: int) -> Metric:
    return GaugeMetricFamily("expbuf_tables", "Tables, including those that never held anything.", value=count)


def _scrub_metrics(scrub: ScrubStatus) -> Iterator[Metric]:
    """The background scrub (store/services/scrub.py): its bound, the pass under way, its totals since the
    start and the last complete pass (kept in the data directory)."""
    gauges = (
        ("expbuf_scrub_bound_bytes_per_second", "The scrub's rate bound (0: no scrub).", scrub.mb_per_second * 1e6),
        ("expbuf_scrub_running", "1 while a scrub pass is under way.", int(scrub.running)),
        ("expbuf_scrub_pass_checked_bytes", "Bytes the pass under way (else the last) checked.",
         scrub.pass_checked_bytes),
        ("expbuf_scrub_pass_total_bytes", "Payload bytes stored when that pass began.", scrub.pass_total_bytes),
        ("expbuf_scrub_last_pass_end_timestamp_seconds", "When the last complete pass ended (0: never).",
         scrub.last_pass_end_unix),
        ("expbuf_scrub_last_pass_seconds", "How long the last complete pass took.", scrub.last_pass_seconds),
    )  # fmt: skip
    for name, text, value in gauges:
        yield GaugeMetricFamily(name, text, value=value)
    counters = (
        ("expbuf_scrub_checked_bytes", "Payload and piece bytes the scrub checked.", scrub.checked_bytes),
        ("expbuf_scrub_checked_experiences", "Experiences the scrub checked.", scrub.checked),
        ("expbuf_scrub_passes", "Complete scrub passes.", scrub.passes),
        (
            "expbuf_scrub_found",
            "Damaged experiences the scrub found and quarantined, and rollouts in pieces it found damaged and dropped.",
            scrub.found,
        ),
    )
    for name, text, value in counters:
        yield CounterMetricFamily(name, text, value=value)


def _build_metrics(builds: list[IndexBuild]) -> Iterator[Metric]:
    """The background builds of the indexes tables lack (store/services/index_builds.py), while each is to
    do or under way: no series once a table keeps the index."""
    labels = ["table", "index"]
    gauges = (
        ("expbuf_index_build_ready_groups", "A table's ready groups when the build of its index started.", "ready"),
        ("expbuf_index_build_indexed_groups", "Ready groups that build has indexed so far.", "indexed"),
        ("expbuf_index_build_waiting_requests", "Requests waiting for that build.", "waiting"),
    )
    for name, text, field in gauges:
        family = GaugeMetricFamily(name, text, labels=labels)
        for build in builds:
            family.add_metric([build.table, build.index], getattr(build, field))
        yield family


def _ledger_metrics(datasets: dict[str, list[DatasetRecord]]) -> Iterator[Metric]:
    """The prompt ledger's counts by table and dataset (tables without a dataset have none)."""
    labels = ["table", "dataset"]
    prompts = GaugeMetricFamily("expbuf_prompts", "Prompts of a dataset by state.", labels=[*labels, "state"])
    reissued = CounterMetricFamily(
        "expbuf_prompt_claims_reissued",
        "Claims handed out again: a claim ended, or a dropped group's retry.",
        labels=labels,
    )
    dropped = CounterMetricFamily(
        "expbuf_prompt_attempts_dropped", "Incomplete groups of attempts whose claim ended, dropped.", labels=labels
    )
    skipped = CounterMetricFamily(
        "expbuf_prompts_skipped",
        "Prompts an epoch skipped at the cursor: their group's rewards were all equal (zero_variance skip).",
        labels=labels,
    )
    bands = GaugeMetricFamily(
        "expbuf_prompts_by_pass_rate",
        "Prompts generated at least once, by the band of their pass rate: zero, low (< 1/2), high (< 1), all.",
        labels=[*labels, "band"],
    )
    for table, records in datasets.items():
        for ds in records:
            for band in PASS_BANDS:
                bands.add_metric([table, ds.name, band], ds.pass_bands.get(band, 0))
            by_state = ds.overall()  # the dataset record's totals: no epoch is read
            for state in PROMPT_STATES:
                prompts.add_metric([table, ds.name, state], by_state[state])
            reissued.add_metric([table, ds.name], ds.reissued)
            dropped.add_metric([table, ds.name], ds.attempts_dropped)
            skipped.add_metric([table, ds.name], ds.skipped)
    yield from (prompts, reissued, dropped, skipped, bands)


def _shaping_metrics(tables: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """What reward shaping and advantage clipping did, by table (and clipping step)."""
    penalised = CounterMetricFamily(
        "expbuf_shaping_overlong_penalised", "Experiences whose reward the overlong penalty lowered.", labels=["table"]
    )
    seen = CounterMetricFamily(
        "expbuf_shaping_seen", "Values a clipping step looked at (advantages: per token).", labels=["table", "step"]
    )
    clipped = CounterMetricFamily("expbuf_shaping_clipped", "Values a clipping step clipped.", labels=["table", "step"])
    ratio = GaugeMetricFamily(
        "expbuf_shaping_clipped_ratio", "Clipped part of the values a clipping step saw.", labels=["table", "step"]
    )
    mean = GaugeMetricFamily("expbuf_reward_running_mean", "Running mean of the rewards seen.", labels=["table"])
    std = GaugeMetricFamily("expbuf_reward_running_std", "Running std of the rewards seen.", labels=["table"])
    for table, stats in tables.items():
        penalised.add_metric([table], stats["overlong_penalised"])
        for step in _CLIP_STEPS:
            total, count = stats[f"{step}s_seen"], stats[f"{step}s_clipped"]
            seen.add_metric([table, step], total)
            clipped.add_metric([table, step], count)
            ratio.add_metric([table, step], count / total if total else 0.0)
        moments = RunningMoments.of(stats["reward_moments"])
        mean.add_metric([table], moments.mean)
        std.add_metric([table], moments.std)
    yield from (penalised, seen, clipped, ratio, mean, std)
