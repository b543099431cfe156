"""Every Prometheus metric tokenbus exports, in two registries: the edge's (`EDGE`) and the worker's
(prometheus_client's default registry, beside the engine's own `vllm:*` metrics), so that neither shows the
other's series; each is served on its process's metrics port (shared/runtime/exposition.py). No `_created` series.

Labels are bounded: routes, status codes, error codes, finish reasons, served models, and tenants (the first
`metrics_max_tenants` seen by a process; the rest are counted as `other`)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import ClassVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

disable_created_metrics()

EDGE = CollectorRegistry(auto_describe=True)
WORKER = REGISTRY
OTHER_TENANTS = "other"


class TenantLabels:
    """The tenant label of a process's metrics: the first `limit` tenants it sees keep their own name (a
    long-lived service's big tenants come early and stay), every later one is `other`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.named: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant in self.named:
            return tenant
        if len(self.named) < self.limit:
            self.named.add(tenant)
            return tenant
        return OTHER_TENANTS

class Tally:
    """One series of a TallyCounter: a plain number."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class Level(Tally):
    """One series of a TallyGauge: a plain number that goes up and down."""

    __slots__ = ()

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


class Bins:
    """One series of a TallyHistogram: a count per bucket (found by bisection, in C) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _Tallied(Collector):
    """Series kept as plain numbers, turned into Prometheus samples only when scraped: for what changes on every
    token or request. prometheus_client's Counter, Gauge and Histogram take a lock and check their state on each
    change, several times the cost of a plain number's; the edge observed every token's gap in a Histogram, which
    was a noticeable share of its CPU at one stream (a wake per token finds that code cold), and a request changes
    about a dozen series. The event loop's thread is the only writer; a scrape from another thread reads numbers
    that a write may change under it, never a torn one."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        registry.register(self)

    family: ClassVar[type[CounterMetricFamily] | type[GaugeMetricFamily] | type[HistogramMetricFamily]]

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def _family(self) -> Metric:
        return self.family(self.name, self.documentation, labels=self.labelnames)


class TallyCounter(_Tallied):
    """A Prometheus counter (`<name>_total`) bumped as a plain number."""

    family = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.series: dict[tuple[str, ...], Tally] = {} if labelnames else {(): Tally()}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> Tally:
        if (tally := self.series.get(values)) is None:
            tally = self.series[values] = Tally()
        return tally

    def inc(self, amount: float = 1) -> None:
        self.series[()].value += amount

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, tally in list(self.series.items()):
            family.add_metric(values, tally.value)
        yield family


class TallyGauge(_Tallied):
    """A Prometheus gauge (of labelled series) moved as a plain number."""

    family = GaugeMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.series: dict[tuple[str, ...], Level] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> Level:
        if (level := self.series.get(values)) is None:
            level = self.series[values] = Level()
        return level

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, level in list(self.series.items()):
            family.add_metric(values, level.value)
        yield family


class TallyHistogram(_Tallied):
    """A Prometheus histogram whose observations are counted as plain numbers."""

    family = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.bounds = (*sorted(buckets), float("inf"))
        self.series: dict[tuple[str, ...], Bins] = {}
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> Bins:
        if (bins := self.series.get(values)) is None:
            bins = self.series[values] = Bins(self.bounds)
        return bins

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, bins in list(self.series.items()):
            counts, total, cumulative = list(bins.counts), bins.sum, 0
            buckets = []
            for bound, count in zip(self.bounds, counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(values, buckets, total)
        yield family


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)

# edge: requests
REQUESTS = TallyCounter("tokenbus_edge_requests", "Requests answered by the edge", ["route", "status"], registry=EDGE)
IDLE_CONNECTIONS_CLOSED = Counter(
    "tokenbus_edge_idle_connections_closed", "Idle client connections an edge closed because its open files ran low "
    "(services.edge.server.RESERVED_FILES)", registry=EDGE)
REJECTIONS = Counter("tokenbus_edge_rejections", "Requests answered with an error, by route and error code",
                     ["route", "reason"], registry=EDGE)
TIME_TO_FIRST_TOKEN = TallyHistogram(
    "tokenbus_edge_time_to_first_token_seconds", "From request arrival to the first token event",
    ["model"], buckets=_LATENCY_BUCKETS, registry=EDGE,
)
INTER_TOKEN_LATENCY = TallyHistogram(
    "tokenbus_edge_inter_token_latency_seconds", "Between a stream's token events, per token", ["model"],
    buckets=_TOKEN_GAP_BUCKETS, registry=EDGE,
)
REQUEST_DURATION = TallyHistogram(
    "tokenbus_edge_request_duration_seconds", "From request arrival to the last byte sent", ["model"],
    buckets=_LATENCY_BUCKETS, registry=EDGE,
)
IN_FLIGHT = TallyGauge("tokenbus_edge_requests_in_flight", "Requests waiting for or streaming tokens", ["model"],
                       registry=EDGE)
PROMPT_TOKENS = TallyCounter("tokenbus_edge_prompt_tokens", "Prompt tokens of finished requests", ["model"],
                             registry=EDGE)
STREAMED_TOKENS = TallyCounter("tokenbus_edge_completion_tokens", "Completion tokens delivered to clients",
                               ["model"], registry=EDGE)
FINISH_REASONS = TallyCounter("tokenbus_edge_finish_reasons", "Choices ended, by the engine's reason",
                              ["model", "reason"], registry=EDGE)
"""reason: stop | length | tool_calls | abort"""
CLIENT_DISCONNECTS = Counter("tokenbus_edge_client_disconnects", "Clients gone before their last token",
                             registry=EDGE)
UNKNOWN_FIELDS = Counter("tokenbus_edge_unknown_fields", "Request fields ignored as unknown", ["route"],
                         registry=EDGE)
READY = Gauge("tokenbus_edge_ready", "1 once every model the edge is configured to serve has had a live worker since "
              "it started, while it reaches Redis (what /ready says, refreshed every heartbeat interval), else 0",
              registry=EDGE)
LIVE_WORKERS = Gauge("tokenbus_edge_live_workers", "Workers of a model whose heartbeat is alive (as the edge "
                     "last read them; 0 for a configured model without one)", ["model"], registry=EDGE)
FREE_SLOTS = Gauge("tokenbus_edge_free_slots", "Free job slots of a model's live workers", ["model"],
                   registry=EDGE)

# worker
JOBS = TallyCounter("tokenbus_worker_jobs", "Jobs a worker finished, by outcome", ["model", "outcome"])
RUNNING_JOBS = TallyGauge("tokenbus_worker_running_jobs", "Jobs in the engine now", ["model"])
ENGINE_ABORTS = Counter("tokenbus_worker_engine_aborts", "Requests aborted in the engine", ["model"])
GENERATED_TOKENS = TallyCounter("tokenbus_worker_generated_tokens", "Tokens generated", ["model"])
EVENT_FLUSHES = TallyCounter("tokenbus_worker_event_flushes", "Pipelined writes of token events to Redis")
EVENTS_PUBLISHED = TallyCounter("tokenbus_worker_events_published", "Token events written to Redis")
ENGINE_RUNNING = Gauge("tokenbus_worker_engine_running_sequences", "Sequences the engine is running (its scheduler)",
                       ["model"])
ENGINE_WAITING = Gauge("tokenbus_worker_engine_waiting_sequences", "Sequences waiting in the engine's scheduler",
                       ["model"])
PREFIX_CACHE_QUERIES = Counter("tokenbus_worker_prefix_cache_queries", "Prompt tokens the engine looked up in its "
                               "prefix cache", ["model"])
PREFIX_CACHE_HITS = Counter("tokenbus_worker_prefix_cache_hits", "Of those, the tokens its prefix cache held (their "
                            "prefill skipped): hits / queries is the model's prefix cache hit rate", ["model"])
CONSTRAINT_CHECKS = Counter("tokenbus_worker_constraint_checks", "Constraints the worker compiled before its engine, "
                            "by outcome", ["model", "outcome"])
"""outcome: known (checked before) | compiled | skipped (nothing XGrammar compiles per request: a JSON
object) | refused_by_xgrammar (vLLM's check answers it) | too_slow | ended (past its memory bound) | unavailable
(no helper could start); too_slow, ended and unavailable are refused (services.worker.grammar_gate)"""
KV_CACHE_USAGE = Gauge("tokenbus_worker_kv_cache_usage_ratio", "Share of the engine's KV cache in use (0-1)",
                       ["model"])

# the request streams, the model's and each worker's own, summed (read by each worker of a model; take the max over
# workers)
STREAM_LENGTH = Gauge("tokenbus_stream_length", "Entries in a model's request streams", ["model"])
STREAM_LAG = Gauge("tokenbus_stream_lag", "Entries of a model's request streams not yet delivered to a worker",
                   ["model"])
STREAM_PENDING = Gauge("tokenbus_stream_pending", "Entries delivered to a worker and not yet acknowledged",
                       ["model"])

# faults
MIGRATIONS = Counter("tokenbus_worker_migrations", "Jobs a worker took over from another, by how", ["model", "how"])
"""how: reclaimed (its owner died) | handed_over (its owner drained)"""
RECLAIMS = Counter("tokenbus_worker_reclaimed_entries", "Queue entries claimed from dead workers", ["model"])
DEAD_LETTERS = Counter("tokenbus_worker_dead_letters", "Jobs moved to the dead-letter stream", ["model"])
HANDOVERS = Counter("tokenbus_worker_handovers", "Jobs a draining worker handed to others", ["model"])
RESUMES = Counter("tokenbus_edge_resumed_streams", "Streams resumed with Last-Event-ID", ["route"], registry=EDGE)
BACKGROUND = Counter("tokenbus_edge_background_responses", "Background responses created, and ended (counted once, "
                     "by the edge that stores the answer) by how: completed, incomplete, failed, cancelled",
                     ["model", "event"], registry=EDGE)
BATCHES = Counter("tokenbus_edge_batches", "Batches created, and ended (counted once, by the edge that ends it) by "
                  "how: completed, expired, cancelled, failed", ["event"], registry=EDGE)
BATCH_LINES = Counter("tokenbus_edge_batch_lines", "Lines of batches answered, by endpoint and outcome: completed "
                      "(its answer in the output file), failed (in the error file), expired", ["endpoint", "outcome"],
                      registry=EDGE)
BATCH_LINES_WAITING = Gauge("tokenbus_edge_batch_lines_waiting", "Lines of the batches this edge drives that wait "
                            "their turn (not yet queued)", registry=EDGE)
BATCH_LINES_RUNNING = Gauge("tokenbus_edge_batch_lines_running", "Lines of batches this edge has queued or running",
                            registry=EDGE)
BATCHES_DRIVEN = Gauge("tokenbus_edge_batches_driven", "Open batches this edge drives", registry=EDGE)
WORKERS_LOST = Counter("tokenbus_edge_workers_lost", "Streams ended because their job's worker died",
                       registry=EDGE)
REDIS_UP = Gauge("tokenbus_edge_redis_up", "1 while the edge reaches Redis, 0 during an outage", registry=EDGE)
REDIS_USED_MEMORY = Gauge("tokenbus_edge_redis_used_memory_bytes",
                          "Memory Redis uses (INFO memory used_memory), read by the edge every few seconds",
                          registry=EDGE)
REDIS_MAXMEMORY = Gauge("tokenbus_edge_redis_maxmemory_bytes",
                        "Redis's maxmemory (0: none set): past it, with noeviction, every write is refused",
                        registry=EDGE)

# tenants
TENANT_REQUESTS = TallyCounter("tokenbus_edge_tenant_requests",
                               "Generation and embedding requests by tenant and outcome",
                               ["tenant", "model", "outcome"], registry=EDGE)
"""outcome: admitted, or the limit that refused it: requests | tokens | concurrency | insufficient_quota (model
"-" for a request refused before its body was read: its request unit is spent first)"""
TENANT_TIME_TO_FIRST_TOKEN = TallyHistogram(
    "tokenbus_edge_tenant_time_to_first_token_seconds", "From request arrival to the first token, by tenant",
    ["tenant", "model"], buckets=_LATENCY_BUCKETS, registry=EDGE,
)
TENANT_TOKENS = TallyCounter("tokenbus_worker_tenant_tokens", "Tokens settled per tenant and model",
                             ["model", "tenant", "kind"])
"""kind: prompt | completion"""

# fair share and admission
QUEUED_JOBS = Gauge("tokenbus_queued_jobs", "Jobs of a model waiting for a worker (as one worker last read it)",
                    ["model"])
QUEUE_WAIT = TallyHistogram("tokenbus_worker_queue_wait_seconds", "From a job's arrival to its start on a worker",
                            ["model", "tenant"], buckets=_LATENCY_BUCKETS)
DISPATCHES = TallyCounter("tokenbus_worker_fair_dispatches", "Jobs this worker moved from tenants' backlogs to the "
                          "model's stream", ["model"])
EDGE_DISPATCHES = TallyCounter("tokenbus_edge_fair_dispatches", "Jobs this edge moved from tenants' backlogs to the "
                               "model's stream", ["model"], registry=EDGE)
_DECISIONS_HELP = ("Jobs the fair scheduler placed, by why they went where they did (cache-aware dispatch): cache | "
                   "waited (onto a worker holding their prefix, at once or after waiting for it), expired (a holder "
                   "stayed busy past the bound) | none (no live worker holds it)")
DISPATCH_DECISIONS = TallyCounter("tokenbus_dispatch_decisions", _DECISIONS_HELP, ["model", "reason"])
EDGE_DISPATCH_DECISIONS = TallyCounter("tokenbus_dispatch_decisions", _DECISIONS_HELP, ["model", "reason"],
                                       registry=EDGE)
"""One series in edges and workers alike (both dispatch): sum them across the two."""
ADMISSION_REFUSALS = Counter("tokenbus_edge_admission_refusals", "Requests refused before they were queued",
                             ["model", "reason"], registry=EDGE)
"""reason: queue_full | tenant_queue_full | wait_exceeds_deadline"""


def worker_series(model: str) -> None:
    """Creates a worker's per-model series at 0, so that rates and alerts see them before the first event."""
    for how in ("reclaimed", "handed_over"):
        MIGRATIONS.labels(model, how)
    for counter in (RECLAIMS, DEAD_LETTERS, HANDOVERS, ENGINE_ABORTS, GENERATED_TOKENS, PREFIX_CACHE_QUERIES,
                    PREFIX_CACHE_HITS):
        counter.labels(model)
    for gauge in (RUNNING_JOBS, ENGINE_RUNNING, ENGINE_WAITING, KV_CACHE_USAGE):
        gauge.labels(model)


def edge_series(model: str) -> None:
    """The same for a model an edge is configured to serve."""
    for metric in (PROMPT_TOKENS, STREAMED_TOKENS, IN_FLIGHT):
        metric.labels(model)
