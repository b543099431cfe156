"""Queues jobs through their model's scheduler (shared.tenancy.fairshare). A job that finds no write in flight
is written on the spot, in the step of its request, on a connection held for good: deferred to a task, its write
would wait for whatever else the loop had ready (at many streams, often a step's tokens for every client). The jobs
of the requests that were ready in the same pass follow it at once, in one write; those that arrive while writes
are in flight go out together once their replies are in: a burst costs the edge a few writes, not one each.
Admission happens in the same write: a refused job leaves nothing queued."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from services.edge.redis_boundary import REDIS_FAILURES
from shared.protocol import bus
from shared.protocol.errors import TokenbusError
from shared.redisio import rawpipe
from shared.redisio.rawpipe import PipelineLike
from shared.runtime import metrics
from shared.tenancy import fairshare

WAKE_MARGIN_S = 0.005
"""After a bound's end, so that the dispatch finds it over (Redis's clock and ours agree to a few ms on one host)."""
WAKE_COALESCE_S = 0.025
"""Dispatches for bounds ending this close together are one."""

Record = tuple[str, bytes, int]
"""A key written with a job: (key, value, time to live in ms)."""
Outcome = fairshare.Admitted | Exception
"""Of one put: admitted, refused (a TokenbusError), or failed (a RedisError)."""


@dataclass(eq=False)
class _Put:
    job: bus.Job
    encoded: bytes
    record: Record | None
    written: asyncio.Future[fairshare.Admitted]
    retried: bool = False
    """Sent again once already, after Redis had lost the scheduler's scripts."""
    affine: bool = False
    """It may wait for a busy worker holding its prefix."""


class JobQueue:
    """`put` returns once the job is queued; it raises the refusal (a TokenbusError) if admission refused it,
    and RedisError if it could not be written."""

    def __init__(self, redis: aioredis.Redis, scheduler: fairshare.Scheduler) -> None:
        self.redis = redis
        self.pipelines = rawpipe.Pipelines(redis)
        """Raw writes on one of the pool's connections, held: the enqueue is on every request's way to its first
        token."""
        self.scheduler = scheduler
        self.batch: list[_Put] = []
        self.writer: asyncio.Task[None] | None = None
        self.wakeups: dict[str, float] = {}
        """Per model, when (loop time) the last dispatch this edge set for a bound's end runs."""
        self.waking: set[asyncio.Task[Any]] = set()

    async def put(self, job: bus.Job, record: Record | None = None) -> fairshare.Admitted:
        """Enqueues a job; `record` (key, value, ttl in ms) is written with it, before it (and removed again if
        the job is refused)."""
        written: asyncio.Future[fairshare.Admitted] = asyncio.get_running_loop().create_future()
        self.batch.append(_Put(job, bus.encode_job(job), record, written))
        if self.writer is None or self.writer.done():
            batch, self.batch = self.batch, []
            pipe = self._pipeline(batch)
            sent = self._send_now(pipe)
            self.writer = asyncio.create_task(self._write_batches(batch, pipe, sent), name="job-queue")
        return await written

    async def _write_batches(self, batch: list[_Put], pipe: PipelineLike, sent: bool) -> None:
        """Reads the outcomes of a write (`sent` already, or sent here), then writes what gathered meanwhile."""
        if sent and self.batch and isinstance(pipe, rawpipe.RawPipeline):
            # the jobs of the requests that were ready with the first follow it at once, before its replies
            more, self.batch = self.batch, []
            follow = self._pipeline(more)
            if self._send_now(follow):
                batch, pipe.commands = batch + more, pipe.commands + cast(rawpipe.RawPipeline, follow).commands
            else:
                self.batch[:0] = more
        while batch:
            outcomes = await self._write(batch, pipe, sent)
            unscripted = [put for put, outcome in zip(batch, outcomes, strict=True)
                          if isinstance(outcome, NoScriptError) and not put.retried]
            refused: list[str] = []
            for put, outcome in zip(batch, outcomes, strict=True):
                if put not in unscripted and self._resolve(put, outcome) and put.record is not None:
                    refused.append(put.record[0])
            if unscripted:
                await self._send_again(unscripted)
            if refused:
                await self._forget(refused)
            batch, self.batch = self.batch, []
            if batch:
                pipe, sent = self._pipeline(batch), False

    def _pipeline(self, batch: list[_Put]) -> PipelineLike:
        pipe = self.pipelines.pipeline()
        for put in batch:
            if put.record is not None:
                pipe.execute_command("SET", put.record[0], put.record[1], "PX", put.record[2])
            put.affine = self.scheduler.enqueue(pipe, put.job, put.encoded)
        return pipe

    def _send_now(self, pipe: PipelineLike) -> bool:
        """Writes a raw pipeline's commands on the spot, their replies to be read by `_write`; False when it cannot
        be done without waiting (no connection yet, or a cluster's pipeline): `_write` sends them."""
        held = self.pipelines.held
        return isinstance(pipe, rawpipe.RawPipeline) and held is not None and held.try_send_unread(pipe.commands)

    async def _write(self, batch: list[_Put], pipe: PipelineLike, sent: bool) -> list[Outcome]:
        """Per job of a batch, its outcome (the first failure of its commands, if any)."""
        commands = len(pipe)  # a failed execute empties the pipeline
        try:
            results = iter(await self._replies(pipe, sent))
        except REDIS_FAILURES as exc:
            failure = exc if isinstance(exc, RedisError) else RedisConnectionError(str(exc))
            results = iter([failure] * commands)
        outcomes: list[Outcome] = []
        for put in batch:
            mine = [next(results)] if put.record is None else [next(results), next(results)]
            failed = next((r for r in mine if isinstance(r, Exception)), None)
            outcomes.append(failed if failed is not None else fairshare.outcome(mine[-1]))
        return outcomes

    async def _replies(self, pipe: PipelineLike, sent: bool) -> list[Any]:
        held = self.pipelines.held
        if sent and held is not None:
            try:
                return await held.read_unread()
            except RedisConnectionError:
                # the held connection died idle (Redis restarted): once more on a fresh one, as a pipeline's execute
                # retries a connection error
                pass
        return await pipe.execute(raise_on_error=False)

    def _resolve(self, put: _Put, outcome: Outcome) -> bool:
        """Settles a put's future; True if admission refused the job."""
        if isinstance(outcome, fairshare.Admitted):
            outcome.dispatched.count(put.job.model, metrics.EDGE_DISPATCHES, metrics.EDGE_DISPATCH_DECISIONS)
            if outcome.member and put.affine:
                self._wake_at_bound(put.job.model)
        elif isinstance(outcome, TokenbusError):
            metrics.ADMISSION_REFUSALS.labels(put.job.model, outcome.code).inc()
        if not put.written.done():  # else its request went away meanwhile (its job is cancelled on the way out)
            if isinstance(outcome, fairshare.Admitted):
                put.written.set_result(outcome)
            else:
                put.written.set_exception(outcome)
        return isinstance(outcome, TokenbusError)

    async def _send_again(self, puts: list[_Put]) -> None:
        """Redis lost the scripts (a restart): load them and send these jobs once more."""
        try:
            await self.scheduler.load()
        except REDIS_FAILURES as exc:
            failure = exc if isinstance(exc, RedisError) else RedisConnectionError(str(exc))
            for put in puts:
                self._resolve(put, failure)
            return
        for put in puts:
            put.retried = True
        self.batch[:0] = puts

    def _wake_at_bound(self, model: str) -> None:
        """A queued job may wait for a busy worker holding its prefix until its bound: a dispatch then sends it on
        (to any worker) even if no job ends and no worker beats meanwhile. One per model within WAKE_COALESCE_S."""
        wait_s = self.scheduler.affinity_wait_s()
        if wait_s <= 0:
            return
        loop = asyncio.get_running_loop()
        at = loop.time() + wait_s + WAKE_MARGIN_S
        if abs(self.wakeups.get(model, -math.inf) - at) < WAKE_COALESCE_S:
            return
        self.wakeups[model] = at
        loop.call_at(at, self._wake, model)

    def _wake(self, model: str) -> None:
        task = asyncio.create_task(self._dispatch(model), name="bound-dispatch")
        self.waking.add(task)
        task.add_done_callback(self.waking.discard)

    async def _dispatch(self, model: str) -> None:
        with contextlib.suppress(*REDIS_FAILURES):
            moved = await self.scheduler.dispatch(model)
            moved.count(model, metrics.EDGE_DISPATCHES, metrics.EDGE_DISPATCH_DECISIONS)

    async def _forget(self, records: list[str]) -> None:
        """Removes the resume records of refused jobs: there is nothing to resume."""
        with contextlib.suppress(*REDIS_FAILURES):
            pipe = self.redis.pipeline(transaction=False)
            for key in records:
                pipe.delete(key)
            await pipe.execute()
