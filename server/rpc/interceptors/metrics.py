"""Prometheus metrics of an expbuf server.

What the store keeps durably is read from it at every scrape (store_metrics.py). What only the
server sees (RPC latency by method and code, refusals before anything reaches the store, advantage
time, staleness of sampled experiences) is measured here. Each server has its own registry.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from expbuf.client.rpc.wire import reason_of

from ...store import Store
from .base import CALL_TABLE, ServiceInterceptor, table_of
from .store_metrics import StoreCollector

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TableMetric = TypeVar("TableMetric", Counter, Histogram)


class ShardLabel(Collector):
    """Every metric of a registry with a `shard` label added: one dashboard for all shards."""

    def __init__(self, inner: CollectorRegistry, shard: str) -> None:
        self.inner = inner
        self.shard = shard

    def collect(self) -> Iterator[Metric]:
        for metric in self.inner.collect():
            metric.samples = [s._replace(labels={"shard": self.shard, **s.labels}) for s in metric.samples]
            yield metric

    def describe(self) -> Iterator[Metric]:
        """The families of the registry it labels (a scrape of the server's start), so that a scrape
        that names the metrics it wants (`?name[]=`) finds them: it found none of a shard's."""
        yield from self.inner.collect()


class Metrics:
    """The metrics an expbuf server exports, in a registry of its own.

    A shard of a sharded buffer (`shard` set) exports them all with a `shard` label.
    """

    def __init__(self, store: Store, shard: str = "") -> None:
        self._store = store
        self._tables = threading.Lock()  # a table's series made (of_table) or removed (forget_table)
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store))
        self.rpc_duration = Histogram(
            "expbuf_rpc_duration_seconds",
            "RPC duration by method and status code (streams: the whole stream).",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.refused = Counter(
            "expbuf_refused", "Requests refused, by reason.", ["table", "reason"], registry=self.registry
        )
        self.advantage_seconds = Histogram(
            "expbuf_advantage_seconds",
            "Time to compute the advantages of the groups completed together.",
            ["table", "estimator"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.advantage_failures = Counter(
            "expbuf_advantage_failures",
            "Groups whose advantage computation raised: retried later (every group of it failed, a cause that"
            " may pass), or failed.",
            ["table", "estimator", "outcome"],
            registry=self.registry,
        )
        self.advantage_worker_up = Gauge(
            "expbuf_advantage_worker_up",
            "1 while the advantage worker runs, and while none is needed (no table has needed advantages computed"
            " since the start: torch is not loaded); 0 while torch loads, and where the worker did not start or"
            " ended (ServerInfo.advantage_worker_failure names why; .advantage_worker_state tells the four apart).",
            registry=self.registry,
        )
        self.admission = Counter(
            "expbuf_admit_requests",
            "Admit requests by outcome (granted, or no_room within the wait).",
            ["table", "outcome"],
            registry=self.registry,
        )
        self.staleness = Histogram(
            "expbuf_sample_staleness_versions",
            "Trainer version (else the newest version pushed) minus the version of each sampled experience.",
            ["table"],
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=self.registry,
        )
        # what the server counts itself by table, with each one's label names: a dropped table's go with it
        self._by_table: tuple[tuple[Counter | Histogram, tuple[str, ...]], ...] = (
            (self.refused, ("table", "reason")),
            (self.advantage_seconds, ("table", "estimator")),
            (self.advantage_failures, ("table", "estimator", "outcome")),
            (self.admission, ("table", "outcome")),
            (self.staleness, ("table",)),
        )
        self.exported = self.registry
        if shard:
            self.exported = CollectorRegistry()
            self.exported.register(ShardLabel(self.registry, shard))

    def of_table(
        self, metric: TableMetric, table: str, *labels: str, table_id: int | None = None
    ) -> TableMetric | None:
        """The table's series of `metric` (its other labels `labels`) to count in, or None where the
        table is gone. A call or a computation still under way as its table is dropped records after
        the drop: its series is made under the lock that forget_table holds once the store has
        dropped the table, so it is made before and removed with the others, or not made at all;
        never made after, to stay in every scrape until a restart. A count into a series removed
        meanwhile goes nowhere. `table_id`: the table a computation read its groups from, which a
        table made again under the name since is not: it gets none of the old one's counts (a
        call's records go by the name it named, as the store serves it)."""
        with self._tables:
            return metric.labels(table, *labels) if self._store.has_table(table, table_id) else None

    def forget_table(self, table: str) -> None:
        """Remove a dropped table's series of what the server counts itself, as its store's go with
        it: else every table ever made stays in each scrape, and one made again under the name
        goes on from the old one's counts. Called once the store has dropped it (of_table)."""
        with self._tables:
            for metric, labels in self._by_table:
                children = {
                    tuple(sample.labels[name] for name in labels)
                    for family in metric.collect()
                    for sample in family.samples
                    if sample.labels.get("table") == table
                }
                for values in children:
                    with contextlib.suppress(KeyError):  # a concurrent drop of the same table removed it
                        metric.remove(*values)


class RpcMetrics(ServiceInterceptor):
    """Times every RPC of the ExperienceBuffer service and records its status code; counts each
    refusal by its table and reason, from the trailer every refusal carries (base.refuse), so that
    one refused by an interceptor (busy, inflight_full, a token's) counts as one refused by the
    store does. The outermost interceptor: it sees every call's end."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        series: dict[str, Histogram] = {}  # this method's, by status code: made once each (none is removed)

        def observe(context: grpc.ServicerContext, outcome: str, seconds: float) -> None:
            code = _code(context, outcome)
            found = series.get(code)
            if found is None:
                found = series[code] = self.metrics.rpc_duration.labels(method, code)
            found.observe(seconds)
            if code != "OK" and (reason := reason_of(context.trailing_metadata())) is not None:
                refused, table = self.metrics.refused, CALL_TABLE.get()
                (self.metrics.of_table(refused, table, reason) or refused.labels("unknown", reason)).inc()

        def begin(request: Any) -> None:
            """The call's table where its request names it (a stream's, or a message read later,
            names it when read: "" until then, counted as unknown)."""
            CALL_TABLE.set(table_of(request) if isinstance(request, Message) else "")

        def timed_unary(behavior: Callable) -> Callable:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                begin(request)
                start, outcome = time.perf_counter(), "UNKNOWN"
                try:
                    result = behavior(request, context)
                    outcome = "OK"
                    return result
                finally:
                    observe(context, outcome, time.perf_counter() - start)

            return run

        def timed_stream(behavior: Callable) -> Callable:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                begin(request)
                start, outcome = time.perf_counter(), "UNKNOWN"
                try:
                    yield from behavior(request, context)
                    outcome = "OK"
                except GeneratorExit:
                    outcome = "CANCELLED"
                    raise
                finally:
                    observe(context, outcome, time.perf_counter() - start)

            return run

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                timed_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                timed_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                timed_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                timed_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler


def _code(context: grpc.ServicerContext, outcome: str) -> str:
    """The status the handler set (an abort), else how it ended: OK, CANCELLED or UNKNOWN."""
    code = context.code()  # type: ignore[attr-defined]  # grpcio's server context has code(); types-grpcio omits it
    if code is None:
        return outcome
    return code.name if isinstance(code, grpc.StatusCode) else str(code)
