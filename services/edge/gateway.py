"""The edge's side of the bus: enqueue jobs, cancel them, and know which models have live workers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.edge.directory import ModelDirectory
from services.edge.enqueue import JobQueue, Record
from services.edge.jobevents import JobEvents
from services.edge.redis_boundary import REDIS_FAILURES, redis_boundary, unavailable
from services.edge.relay import EventRelay, add_cancel
from services.edge.sse import ClientGone
from shared.protocol import bus, keys
from shared.protocol.errors import (
    AdapterUnavailable,
    InvalidRequest,
    ModelNotFound,
    ModelUnavailable,
    QueueTimeout,
    TokenbusError,
    Unauthenticated,
)
from shared.tenancy import fairshare
from shared.tenancy.adapters import Adapter
from shared.tenancy.limits import Settlements

log = logging.getLogger(__name__)


MODEL_RETRY_AFTER_S = 5.0
"""Retry-After of a model whose workers are all restarting (a vLLM worker takes 15 s and more to start)."""

CANCEL_LATER_S = 600.0
"""How long an edge tries again to send a revoked key's background jobs' cancels through a Redis outage."""

STOPS_BACKGROUND = (Unauthenticated, QueueTimeout)
"""The errors found at the edge that stop a background job too: its key was revoked, no worker started it in time
(others, a Redis outage say, end only this edge's view of it)."""


class Gateway:
    """Submits jobs and yields their events; every call has a deadline."""

    def __init__(self, redis: aioredis.Redis, relay: EventRelay, directory: ModelDirectory,
                 scheduler: fairshare.Scheduler, settlements: Settlements, resume_window_s: float = 0.0) -> None:
        self.redis = redis
        self.relay = relay
        self.directory = directory
        self.queue = JobQueue(redis, scheduler)
        self.settlements = settlements
        self.waiting: dict[str, tuple[bus.Job, bytes]] = {}
        """Job id -> (job, backlog member) of the jobs this edge queued for the fair scheduler and still serves:
        a job whose client leaves comes off its backlog at once, and its key gets back what it was charged."""
        self.resume_window_s = resume_window_s
        self.streams_of_key: dict[str, set[JobEvents]] = {}
        """The jobs this edge serves, by the id of the API key they were admitted for: a revoke ends them."""
        self.readers_of_key: dict[str, set[JobEvents]] = {}
        """The resumed streams this edge serves, by the id of the API key that reads them where it is not the key
        their job was admitted for: a revoke of it ends them, not their jobs."""
        self.cancelling: set[asyncio.Task[None]] = set()
        """The cancels of revoked keys' background jobs under way."""

    def check_redis(self) -> None:
        """Refuses at once while Redis is known to be unreachable, instead of waiting on a connect."""
        if self.relay.redis_down():
            raise unavailable()

    @contextlib.asynccontextmanager
    async def submit(self, job: bus.Job, deadline: float, record: Record | None = None,
                     on_refused: Callable[[bus.Job], Awaitable[None]] | None = None) -> AsyncIterator[JobEvents]:
        """Enqueues the job (with its resume record, if any) or raises its refusal; the block reads its events.
        Leaving early cancels the job, unless it has a resume record and its client (or this edge, draining) went
        away after it started: then it is kept for a resume; a background job runs on whatever happens here, but
        for the errors of STOPS_BACKGROUND. One that no worker started within the queue timeout (and the time its
        start takes to be heard of) ends with queue_timeout, as a worker would end it, and is cancelled: no worker
        starts it after that. A job that cannot be queued (Redis failed, or admission refused it) is handed to
        `on_refused` (its tokens and lease are given back; its request stays spent) before the error leaves."""
        events = self.relay.register(job.id, deadline, self._start_by(job), job.tenant)
        try:
            try:
                self.check_redis()
                with redis_boundary():
                    admitted = await self.queue.put(job, record)
            except TokenbusError as exc:
                if isinstance(exc.__cause__, REDIS_FAILURES):  # its write may have been done and its reply lost
                    await self.cancel(job.id, deadline)  # then no worker runs it for nobody (and for free)
                if on_refused is not None:
                    await on_refused(job)
                raise
            if admitted.member:
                self.waiting[job.id] = (job, admitted.member)
            key_id = job.charge.key if job.charge is not None else "-"
            if job.background and key_id != "-":
                await self._note_background(key_id, job.id, deadline)
            async with self._reading(job, key_id, events, resumable=record is not None):
                yield events
        finally:
            self.relay.unregister(events)
            self.waiting.pop(job.id, None)
            if events.finished and record is None and not (job.replayable or job.background):
                self.relay.drop_log(job.id)  # its end was read here, and nobody may read it again

    @contextlib.asynccontextmanager
    async def _reading(self, job: bus.Job, key_id: str, events: JobEvents, resumable: bool,
                       reader_key: str = "") -> AsyncIterator[None]:
        """A request reads the job's events in the block: a revoke of its key ends it; its leaving early stops
        the job (see `_leaving`), but for a background job, which only a cancel, its deadline and the errors of
        STOPS_BACKGROUND stop. A request that reads with another key than the job's (`reader_key`: a resume) ends
        at a revoke of either; the reader's alone does not stop the job."""
        with self._of_key(key_id, events), self._of_key(reader_key, events, self.readers_of_key):
            if job.background:
                yield
                if isinstance(events.failed_with, STOPS_BACKGROUND) and not events.reader_revoked:
                    await self._let_go(events, keep=False)
                return
            async with self._leaving(events, resumable=resumable):
                yield

    def _start_by(self, job: bus.Job) -> float | None:
        """When (the monotonic clock) a worker must have started the job, by the rule a worker applies (a queue
        timeout from its creation) and the time its start takes to be heard of."""
        if not job.created_ms:
            return None
        left_ms = job.created_ms + self.queue.scheduler.settings.queue_timeout_s * 1000 - bus.now_ms()
        return time.monotonic() + left_ms / 1000 + bus.START_NOTICE_S

    @contextlib.contextmanager
    def _of_key(self, key_id: str, events: JobEvents, registry: dict[str, set[JobEvents]] | None = None
                ) -> Iterator[None]:
        """The request reads its job's events in the block for the API key of id `key_id` (a revoke of it ends
        them), as the job's key (`registry` streams_of_key) or its reader's only (readers_of_key); none for ""."""
        if not key_id:
            yield
            return
        registry = self.streams_of_key if registry is None else registry
        streams = registry.setdefault(key_id, set())
        streams.add(events)
        try:
            yield
        finally:
            streams.discard(events)
            if not streams:
                del registry[key_id]

    def revoked(self, key_id: str) -> None:
        """Ends the streams of a key that was revoked: each client gets the error, each job is cancelled (but a
        job only read with the key: see `_reading`); so is every background job of the key, followed here,
        elsewhere, or (its edge gone) nowhere."""
        revoked = Unauthenticated("The API key of this request was revoked or has expired.")
        for events in list(self.readers_of_key.get(key_id, ())):
            if not events.failing:
                events.reader_revoked = True
            events.fail(revoked)
        for events in list(self.streams_of_key.get(key_id, ())):
            events.reader_revoked = False  # its own key: the job stops too
            events.fail(revoked)
        task = asyncio.create_task(self._cancel_background(key_id))
        self.cancelling.add(task)
        task.add_done_callback(self.cancelling.discard)

    async def _note_background(self, key_id: str, job_id: str, deadline: float) -> None:
        """Notes a background job of the key, for a revoke to find (a failure leaves it to its followers)."""
        ttl_ms = max(1000, int((deadline - time.monotonic()) * 1000))
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.sadd(keys.background_of_key(key_id), job_id)
            pipe.pexpire(keys.background_of_key(key_id), ttl_ms)  # a later job's deadline is later
            await pipe.execute()
        except RedisError as exc:
            log.warning("could not note background job %s for a revoke of its key to find (%s)", job_id,
                        type(exc).__name__)

    async def _cancel_background(self, key_id: str) -> None:
        try:
            members: list[bytes] = await self.redis.smembers(keys.background_of_key(key_id))  # type: ignore[assignment]
        except RedisError as exc:
            log.warning("could not look up the background jobs of a revoked key (%s)", type(exc).__name__)
            return
        deadline = time.monotonic() + CANCEL_LATER_S
        for job_id in members:
            await self.cancel(job_id.decode(), deadline)

    @contextlib.asynccontextmanager
    async def follow(self, job: bus.Job, key_id: str, deadline: float,
                     reader_key: str = "") -> AsyncIterator[JobEvents]:
        """Reads a job another edge began (a resumed stream; `job` as planned again from its record) admitted for
        the API key of id `key_id`, and read with `reader_key` (if another key of its tenant): its owner sends the
        events here from now on, and everything before comes from the job's log. A background job runs on when
        its reader leaves."""
        self.check_redis()
        job_id = job.id
        events = self.relay.register(job_id, deadline, tenant=job.tenant)
        events.gap_at = 0
        try:
            route = bus.Route(job=job_id, reply_to=self.relay.channel)
            ttl_ms = max(1000, int((deadline - time.monotonic()) * 1000))
            with redis_boundary():
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(keys.job_reply_to(job_id), self.relay.channel, px=ttl_ms)
                pipe.execute_command("PUBLISH", keys.ROUTE_CHANNEL, bus.encode_route(route))  # see cancel
                await pipe.execute()
            async with self._reading(job, key_id, events, resumable=True,
                                     reader_key="" if reader_key == key_id else reader_key):
                yield events
        finally:
            self.relay.unregister(events)

    @contextlib.asynccontextmanager
    async def _leaving(self, events: JobEvents, resumable: bool = True) -> AsyncIterator[None]:
        """Stop means stop: a client that closes its connection cancels its job, unless it asked for a stream it
        can resume (`resumable`); so does an edge that is going away (its handlers cancelled): a job nobody can
        resume is not worth running on."""
        try:
            yield
        except (ClientGone, asyncio.CancelledError):
            if not events.finished or events.failing:
                await self._let_go(events, keep=resumable)
            raise
        except BaseException:
            if not events.finished or events.failing:
                await self._let_go(events, keep=False)
            raise
        else:
            if not events.finished or events.failing:  # an error found at the edge: the job must stop too
                await self._let_go(events, keep=resumable and events.reader_revoked)  # (not its reader's key's)

    async def _let_go(self, events: JobEvents, keep: bool) -> None:
        """A job to `keep` that started runs on for the resume window; any other is cancelled. A job a later
        request of this edge reads (its stream resumed here) is that request's to let go."""
        if not self.relay.reads(events):
            return
        if keep and events.owner and self.resume_window_s > 0 and not events.overflowed:
            events.kept = True
            keep_until = bus.now_ms() + int(self.resume_window_s * 1000)
            with contextlib.suppress(RedisError):
                await self.redis.publish(keys.ROUTE_CHANNEL,
                                         bus.encode_route(bus.Route(job=events.job_id, keep_until_ms=keep_until)))
            return
        await self.cancel(events.job_id, events.deadline)

    async def cancel(self, job_id: str, deadline: float) -> None:
        """Takes the job off its backlog if it still waits there (and settles its charge as a job that used
        nothing: no worker will), marks it cancelled (for a worker yet to pick it up) and tells running workers; if
        Redis cannot take that now, the relay's heartbeat sends it later."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            add_cancel(pipe, job_id)
            if waiting := self.waiting.pop(job_id, None):
                job, member = waiting  # a failure of the withdraw leaves it to be dropped (and settled) when dispatched
                self.queue.scheduler.withdraw(pipe, job.model, member)
            results = await pipe.execute(raise_on_error=False)
            if failed := next((r for r in results[:2] if isinstance(r, Exception)), None):
                raise failed
        except REDIS_FAILURES as exc:
            log.warning("could not cancel job %s yet: %r", job_id, exc)
            self.relay.cancel_later(job_id, deadline)
            return
        if waiting and results[2:] == [1]:  # off its backlog, never dispatched
            await self._settle_unused(waiting[0])

    async def _settle_unused(self, job: bus.Job) -> None:
        """Settles the charge of a job that never ran: its tokens come back to its key (its request stays spent, as
        when a worker drops a job cancelled while it waited)."""
        try:
            await self.settlements.settle(job, 0, 0)
        except RedisError as exc:
            log.warning("could not settle job %s, taken off its backlog (%s): its reservation stays spent",
                        job.id, type(exc).__name__)

    async def find_model(self, model: str, tenant: str | None = None, param: str = "model"
                         ) -> tuple[bus.WorkerInfo, Adapter | None]:
        """The heartbeat of a live worker of the model, or of the model an adapter of that name adapts (with the
        adapter) where a caller of `tenant` may see it (None: serving without keys); a 404 if there is none, but
        a 503 to retry for a model served here whose workers are all gone for now (ModelDirectory.resting)."""
        with redis_boundary():
            info, adapter = await self.directory.find(model)
        if info is None and adapter is not None and adapter.visible_to(tenant):
            info = self.directory.models.get(adapter.base)
            if info is not None and adapter.base not in self.directory.lora_models:
                raise AdapterUnavailable(f"The workers of `{adapter.base}` serve no adapters.", param=param)
        else:
            adapter = None
        if info is None and (adapter.base if adapter is not None else model) in self.directory.resting:
            raise ModelUnavailable(f"`{model}` has no live worker right now (its workers are starting); try again "
                                   "shortly.", param=param, retry_after_s=MODEL_RETRY_AFTER_S)
        if info is None:
            raise ModelNotFound(f"The {'adapter' if 'adapter' in param else 'model'} `{model}` does not exist or "
                                "has no live worker.", param=param)
        return info, adapter

    async def require_model(self, model: str, task: str = "generate", tenant: str | None = None,
                            param: str = "model") -> tuple[bus.WorkerInfo, Adapter | None]:
        """Like find_model, and a 400 if the model serves another task (`task`: one, or several joined by '|')."""
        info, adapter = await self.find_model(model, tenant, param)
        if info.task not in task.split("|"):
            what = {"generate": "text generation", "embed": "embeddings", "score": "scoring (a cross-encoder)"}
            wanted = " or ".join(what.get(t, t) for t in task.split("|"))
            raise InvalidRequest(f"The model `{model}` serves {what.get(info.task, info.task)}, not {wanted}.",
                                 param=param, code="wrong_model_task")
        return info, adapter
