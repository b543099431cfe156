"""Fair share of a model's workers between tenants, and admission control, shared by every edge and worker
through Redis: a virtual token counter scheduler (VTC, Sheng et al., OSDI 2024).

Each band and tenant (an "entity") has a counter of the service it received, in weighted tokens divided by its
weight. An edge's `enqueue` admits a job (or refuses it: the model's queue or the tenant's share of it is full,
or the estimated wait is longer than the job may wait) into its tenant's backlog. `dispatch` moves the oldest
job of the backlogged tenant with the least counter, in the highest priority band, onto the model's request
stream while the live workers have room for it, and charges its estimated cost to that counter; edges dispatch
after each enqueue, workers before each read and when jobs end. When a job ends its worker corrects the charge
with the tokens really used. A tenant that comes back from idle starts at the least counter of those waiting, so
idle time does not turn into a burst; a tenant alone gets every slot, and each worker offers a few more, its
headroom, that a tenant holding that many or more may not fill, so that a tenant coming in while another floods
finds one free at once instead of waiting for one of the flood's jobs to end.

Workers keep taking jobs from the request stream through their consumer group, so ownership, reclaims and
hand-overs do not change. `Fifo` (the `fifo` scheduler) puts jobs straight onto the request stream, with the
model's queue bound and the wait estimate but no per-tenant backlogs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis

from shared.protocol import bus, keys, prefixes
from shared.protocol.errors import InvalidRequest, QueueFull, TenantQueueFull, TokenbusError, WaitExceedsDeadline
from shared.redisio.rawpipe import PipelineLike
from shared.runtime.metrics import TallyCounter
from shared.runtime.settings import SlotSettings, engine_seqs, headroom_seqs
from shared.tenancy.fairshare_lua import DISPATCH, ENQUEUE, ENQUEUE_FIFO, QUEUE_FIGURES, WITHDRAW


class SchedulerSettings(SlotSettings, Protocol):
    """The settings the scheduler and a worker's offer read (Settings has them)."""

    @property
    def affinity_wait_ms(self) -> int: ...
    @property
    def dispatch(self) -> str: ...
    @property
    def fair_input_weight(self) -> float: ...
    @property
    def fair_output_weight(self) -> float: ...
    @property
    def heartbeat_ttl_s(self) -> float: ...
    @property
    def max_queued_bytes_per_tenant(self) -> int: ...
    @property
    def max_queued_jobs(self) -> int: ...
    @property
    def max_queued_per_tenant(self) -> int: ...
    @property
    def queue_timeout_s(self) -> float: ...
    @property
    def scheduler(self) -> str: ...


Arg = bytes | str | int | float
"""A script argument."""
MAX_PRIORITY = 999
MAX_RETRY_AFTER_S = 60

ENTITY_FIELD, COST_FIELD = b"e", b"c"
"""Request stream fields of a dispatched job besides the job itself: its band and tenant, and its cost."""


def band_of(priority: int) -> str:
    """The band a priority sorts in: 4 digits, the highest priority first."""
    return f"{1000 - max(-MAX_PRIORITY, min(MAX_PRIORITY, priority)):04d}"


@dataclass(frozen=True)
class Ticket:
    """What a dispatched job was charged, carried on its request stream entry to the worker that settles it."""

    entity: str
    charge: float
    input_price: float
    """Counter units per prompt token: the input weight over the tenant's weight."""
    output_price: float
    sequences: int = 1
    """The worker slots the job takes (shared.protocol.bus.Job.sequences)."""

    def fields(self) -> dict[bytes, bytes]:
        return {ENTITY_FIELD: self.entity.encode(), COST_FIELD: (
            f"{self.charge:.3f} {self.input_price:.6g} {self.output_price:.6g} {self.sequences}").encode()}

    @staticmethod
    def from_fields(fields: dict[bytes, bytes]) -> Ticket | None:
        """The ticket of a request stream entry; None for a job that was not dispatched by the fair scheduler."""
        try:
            charge, input_price, output_price, *sequences = fields[COST_FIELD].split()
            return Ticket(fields[ENTITY_FIELD].decode(), float(charge), float(input_price), float(output_price),
                          int(sequences[0]) if sequences else 1)  # an entry of an older edge: one sequence
        except (KeyError, ValueError, UnicodeDecodeError):
            return None

    def settle(self, prompt_tokens: int, completion_tokens: int, duration_ms: float) -> Settlement:
        used = self.input_price * prompt_tokens + self.output_price * completion_tokens
        return Settlement(self.entity, used - self.charge, duration_ms, self.sequences)


@dataclass(frozen=True)
class Settlement:
    """A finished job's correction of its tenant's counter, and how long it held its slot."""

    entity: str
    correction: float
    duration_ms: float
    sequences: int = 1
    """The slots it held: its entry leaves the request stream with them."""


@dataclass(frozen=True)
class Offer:
    """A worker's slots, good for `ttl_ms`: what `dispatch` fills."""

    worker: str
    slots: int
    """Engine sequences it runs at once (its max_num_seqs and headroom)."""
    ttl_ms: int
    headroom: int = 0
    """Of its slots, those a tenant holding that many or more may not fill (Settings.fair_headroom)."""

    def args(self) -> list[Arg]:
        return [self.worker, self.slots, self.ttl_ms, self.headroom]

    @classmethod
    def of(cls, worker: str, settings: SchedulerSettings) -> Offer:
        """A worker's offer: its slots and headroom as its settings have them, good for a heartbeat's TTL."""
        return cls(worker, engine_seqs(settings), int(settings.heartbeat_ttl_s * 1000), headroom_seqs(settings))


NO_OFFER = Offer("", 0, 0)


PLACEMENT_REASONS = ("cache", "waited", "expired", "none")
"""Why a dispatched job went where it did (shared.tenancy.fairshare_lua): onto a worker holding its prefix at once, or
after waiting for it; onto the model's stream after a holder stayed busy past the bound, or with no holder."""


@dataclass(frozen=True)
class Dispatched:
    """What a dispatch did: the jobs it moved onto request streams, and per reason of PLACEMENT_REASONS how many."""

    sent: int
    placements: tuple[int, ...] = ()

    @classmethod
    def of(cls, reply: Any) -> Dispatched:
        """From a script's reply: {sent, placements...} (a bare count from scripts without placements)."""
        if isinstance(reply, list):
            return cls(int(reply[0]), tuple(int(n) for n in reply[1:]))
        return cls(int(reply))

    def count(self, model: str, dispatches: TallyCounter, decisions: TallyCounter) -> None:
        """Counts what it moved, and its placements by reason, in a process's counters."""
        dispatches.labels(model).inc(self.sent)
        for reason, n in zip(PLACEMENT_REASONS, self.placements, strict=False):
            if n:
                decisions.labels(model, reason).inc(n)


@dataclass(frozen=True)
class Admitted:
    member: bytes
    """Where the job waits in its tenant's backlog (empty for fifo)."""
    dispatched: Dispatched
    """Jobs (of any tenant) the enqueue moved onto the request streams."""


@dataclass(frozen=True)
class Backlog:
    """A model's queue as the gauges show it."""

    queued: int
    """Jobs waiting for a worker: in the backlogs, and on the request streams not yet read."""
    length: int
    """Entries on the request streams (the model's and each worker's own), read or not."""
    pending: int
    """Entries read by a worker and not yet acknowledged."""
    lag: int
    """Entries on the request streams that no worker has read yet."""

    @classmethod
    def of(cls, replies: list[Any]) -> Backlog:
        """From the reply of `Scheduler.read_backlog`'s command, as Redis sent it (a failed one counts 0)."""
        reply = replies[0]
        if isinstance(reply, Exception):
            return cls(0, 0, 0, 0)
        waiting, length, pending, lag = (int(value) for value in reply)
        return cls(waiting + max(0, length - pending), length, pending, lag)


def check_fits(job: bus.Job, info: bus.WorkerInfo | None) -> None:
    """Refuses a job with more sequences than a worker of its model has slots: no worker could ever run it whole
    (None: no worker is known yet, so there is nothing to check against)."""
    if info is None or job.sequences() <= info.slots:
        return
    what, param = (("inputs", "input") if job.kind == "embedding" else
                   ("sequences (prompts x n)", "prompt" if len(job.prompts) > 1 else "n"))
    raise InvalidRequest(f"The request asks for {job.sequences()} {what} at once, more than a worker of `{job.model}` "
                         f"runs at once ({info.slots}, its max_num_seqs); split it into smaller requests.",
                         param=param, code="too_many_sequences")


def refusal(code: str, retry_ms: int) -> TokenbusError:
    """The error a refused enqueue raises, telling the client when to try again."""
    retry_after_s = max(1, min(MAX_RETRY_AFTER_S, math.ceil(retry_ms / 1000)))
    if code == "tenant_queue_full":
        return TenantQueueFull("You have too many requests queued for this model; try again later.",
                               retry_after_s=retry_after_s)
    if code == "wait_exceeds_deadline":
        return WaitExceedsDeadline("The model is too busy to serve the request before its deadline; try again "
                                   "later.", retry_after_s=retry_after_s)
    return QueueFull("The model's queue is full; try again later.", retry_after_s=retry_after_s)


def outcome(result: Any) -> Admitted | TokenbusError:
    """What an enqueue script answered."""
    if result[0] == b"ok":
        return Admitted(bytes(result[1]), Dispatched.of(result[2:]))
    return refusal(result[0].decode(), int(result[1]))


class Scheduler:
    """The scheduler of every model, as one process calls it; the FIFO and fair variants differ in `enqueue`."""

    fair = False

    def __init__(self, redis: aioredis.Redis, settings: SchedulerSettings) -> None:
        self.redis = redis
        self.settings = settings
        self._enqueue = redis.register_script(ENQUEUE)
        self._enqueue_fifo = redis.register_script(ENQUEUE_FIFO)
        self._dispatch = redis.register_script(DISPATCH)
        self._withdraw = redis.register_script(WITHDRAW)
        self._queue_figures = redis.register_script(QUEUE_FIGURES)

    async def load(self) -> None:
        """Loads the scripts (after Redis lost them): pipelines call them by their hash alone."""
        for script in (self._enqueue, self._enqueue_fifo, self._dispatch, self._withdraw, self._queue_figures):
            await self.redis.script_load(script.script)

    def affinity_wait_s(self) -> float:
        """How long a queued job may wait for a busy worker holding its prefix (0: never)."""
        return self.settings.affinity_wait_ms / 1000 if self.fair and self.settings.dispatch == "aware" else 0.0

    def affordable_ms(self, job: bus.Job) -> int:
        """How long the job may wait for a worker: until its deadline, and no longer than the queue timeout."""
        return max(0, min(job.deadline_ms - bus.now_ms(), int(self.settings.queue_timeout_s * 1000)))

    def enqueue(self, pipe: PipelineLike, job: bus.Job, encoded: bytes) -> bool:
        """Adds the job's admission and enqueue to a pipeline; its result goes through `outcome`. Returns whether
        the job may wait for a worker holding its prefix (`affinity_wait_s`)."""
        args: list[Arg] = [encoded, self.settings.max_queued_jobs, self.affordable_ms(job), keys.WORKER_GROUP]
        _pipelined(pipe, self._enqueue_fifo, job.model, args)
        return False

    async def dispatch(self, model: str, offer: Offer = NO_OFFER) -> Dispatched:
        """Offers a worker's slots (if any) and fills the room on the request streams; returns what it moved."""
        return Dispatched.of(await self._dispatch(keys=keys.fair_keys(model), args=offer.args()))

    def offer(self, pipe: PipelineLike, model: str, offer: Offer) -> None:
        """Adds `dispatch` to a pipeline; its result goes through `Dispatched.of`, or is NoScriptError (call
        `dispatch`)."""
        _pipelined(pipe, self._dispatch, model, offer.args())

    def settle(self, pipe: PipelineLike, model: str, settlements: list[Settlement]) -> None:
        """Adds to a pipeline the correction of finished jobs' counters, then a dispatch into their slots."""
        args: list[Arg] = [*NO_OFFER.args()]
        for done in settlements:
            args += [done.entity, f"{done.correction:.3f}", f"{done.duration_ms:.0f}", done.sequences]
        _pipelined(pipe, self._dispatch, model, args)

    def withdraw(self, pipe: PipelineLike, model: str, member: bytes) -> None:
        """Adds to a pipeline taking a job whose client left off its backlog, if it is still there."""
        if member:
            _pipelined(pipe, self._withdraw, model, [member])

    def read_backlog(self, pipe: PipelineLike, model: str) -> None:
        """Adds the read of the model's queue to a pipeline: one script, whose reply `Backlog.of` takes."""
        _pipelined(pipe, self._queue_figures, model, [keys.worker_streams(model)])

    async def backlog(self, model: str) -> Backlog:
        """The model's queue, in one round trip: what waits in the backlogs and on the request stream."""
        pipe = self.redis.pipeline(transaction=False)
        self.read_backlog(pipe, model)
        return Backlog.of(await pipe.execute(raise_on_error=False))

    async def queued(self, model: str) -> int:
        """Jobs of the model waiting for a worker: in the backlogs, and on the request stream not yet read."""
        return (await self.backlog(model)).queued


class FairShare(Scheduler):
    fair = True

    def enqueue(self, pipe: PipelineLike, job: bus.Job, encoded: bytes) -> bool:
        weight = max(job.weight, 1e-3)
        input_price = self.settings.fair_input_weight / weight
        output_price = self.settings.fair_output_weight / weight
        # the edge's estimates (services.edge.admission); every job costs something, estimated or not
        charge = max(1.0, input_price * job.prompt_estimate + output_price * job.output_budget)
        cost = Ticket("", charge, input_price, output_price, job.sequences()).fields()
        args: list[Arg] = [job.tenant.replace("\0", ""), band_of(job.priority), cost[COST_FIELD], encoded,
                self.settings.max_queued_jobs, self.settings.max_queued_per_tenant, self.affordable_ms(job),
                self.settings.max_queued_bytes_per_tenant, affinity := self.affinity(job)]
        _pipelined(pipe, self._enqueue, job.model, args)
        return bool(affinity) and self.affinity_wait_s() > 0

    def affinity(self, job: bus.Job) -> str:
        """What the enqueue script places the job by: how long it may wait for a busy worker holding its prompt's
        prefix (ms), then its prefix chain; '' for none (blind dispatch, or nothing to place by)."""
        if self.settings.dispatch != "aware" or not (chain := prefixes.chain(job)):
            return ""
        return f"{max(0, self.settings.affinity_wait_ms)} {' '.join(chain)}"


def _pipelined(pipe: PipelineLike, script: Any, model: str, args: list[Arg]) -> None:
    """Adds a call of a fair-share script on the model's keys, by its hash, as a raw EVALSHA: a Redis
    Cluster's pipeline routes that by its keys, and refuses its `evalsha` method."""
    script_keys = keys.fair_keys(model)
    pipe.execute_command("EVALSHA", script.sha, len(script_keys), *script_keys, *args)


def for_settings(redis: aioredis.Redis, settings: SchedulerSettings) -> Scheduler:
    return FairShare(redis, settings) if settings.scheduler == "fair" else Scheduler(redis, settings)
