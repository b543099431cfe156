"""Every Prometheus metric tokenbus exports. Labels are bounded: routes, status codes, served models, and
tenants (the first `metrics_max_tenants` seen by a process; the rest are counted as `other`)."""

from prometheus_client import Counter, Gauge, Histogram

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

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# edge
REQUESTS = Counter("tokenbus_edge_requests", "Requests answered by the edge", ["route", "status"])
TIME_TO_FIRST_TOKEN = Histogram(
    "tokenbus_edge_time_to_first_token_seconds", "From request arrival to the first token event",
    ["route"], buckets=_LATENCY_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "tokenbus_edge_request_duration_seconds", "From request arrival to the last byte sent",
    ["route"], buckets=_LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge("tokenbus_edge_requests_in_flight", "Requests waiting for or streaming tokens")
STREAMED_TOKENS = Counter("tokenbus_edge_completion_tokens", "Completion tokens delivered to clients")
CLIENT_DISCONNECTS = Counter("tokenbus_edge_client_disconnects", "Clients gone before their last token")
UNKNOWN_FIELDS = Counter("tokenbus_edge_unknown_fields", "Request fields ignored as unknown", ["route"])

# worker
JOBS = Counter("tokenbus_worker_jobs", "Jobs a worker finished, by outcome", ["model", "outcome"])
RUNNING_JOBS = Gauge("tokenbus_worker_running_jobs", "Jobs in the engine now", ["model"])
ENGINE_ABORTS = Counter("tokenbus_worker_engine_aborts", "Requests aborted in the engine", ["model"])
GENERATED_TOKENS = Counter("tokenbus_worker_generated_tokens", "Tokens generated", ["model"])
EVENT_FLUSHES = Counter("tokenbus_worker_event_flushes", "Pipelined writes of token events to Redis")
EVENTS_PUBLISHED = Counter("tokenbus_worker_events_published", "Token events written to Redis")

# faults
MIGRATIONS = Counter("tokenbus_worker_migrations", "Jobs a worker took over from another, by how", ["model", "how"])
"""how: reclaimed (its owner died) | handed_over (its owner drained)"""
RECLAIMS = Counter("tokenbus_worker_reclaimed_entries", "Queue entries claimed from dead workers", ["model"])
DEAD_LETTERS = Counter("tokenbus_worker_dead_letters", "Jobs moved to the dead-letter stream", ["model"])
HANDOVERS = Counter("tokenbus_worker_handovers", "Jobs a draining worker handed to others", ["model"])
RESUMES = Counter("tokenbus_edge_resumed_streams", "Streams resumed with Last-Event-ID", ["route"])
WORKERS_LOST = Counter("tokenbus_edge_workers_lost", "Streams ended because their job's worker died")
REDIS_UP = Gauge("tokenbus_edge_redis_up", "1 while the edge reaches Redis, 0 during an outage")

# tenants
TENANT_REQUESTS = Counter("tokenbus_edge_tenant_requests", "Generation and embedding requests by tenant and outcome",
                          ["tenant", "model", "outcome"])
"""outcome: admitted, or the limit that refused it: requests | tokens | concurrency | insufficient_quota"""
TENANT_TIME_TO_FIRST_TOKEN = Histogram(
    "tokenbus_edge_tenant_time_to_first_token_seconds", "From request arrival to the first token, by tenant",
    ["tenant", "model"], buckets=_LATENCY_BUCKETS,
)
TENANT_TOKENS = Counter("tokenbus_worker_tenant_tokens", "Tokens settled per tenant and model",
                        ["model", "tenant", "kind"])
"""kind: prompt | completion"""

# fair share and admission
QUEUED_JOBS = Gauge("tokenbus_queued_jobs", "Jobs of a model waiting for a worker (as one worker last read it)",
                    ["model"])
QUEUE_WAIT = Histogram("tokenbus_worker_queue_wait_seconds", "From a job's arrival to its start on a worker",
                       ["model", "tenant"], buckets=_LATENCY_BUCKETS)
DISPATCHES = Counter("tokenbus_fair_dispatches", "Jobs this process moved from tenants' backlogs to workers",
                     ["model"])
ADMISSION_REFUSALS = Counter("tokenbus_edge_admission_refusals", "Requests refused before they were queued",
                             ["model", "reason"])
"""reason: queue_full | tenant_queue_full | wait_exceeds_deadline"""
