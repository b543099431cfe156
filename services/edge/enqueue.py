"""Queues jobs through their model's scheduler (shared.fairshare): the jobs of every request that arrives in the
same instant go out in one pipelined write, so a burst of requests costs the edge one round trip, not one each.
Admission happens in that write too: a refused job leaves nothing queued."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from shared import bus, fairshare, metrics, rawpipe
from shared.errors import TokenbusError

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


class JobQueue:
    """`put` returns once the job is queued; it raises the refusal (a TokenbusError) if admission refused it,
    and RedisError if it could not be written."""

    def __init__(self, redis: aioredis.Redis, scheduler: fairshare.Scheduler) -> None:
        self.redis = redis
        self.pipelines = rawpipe.Pipelines(redis, keep=False)
        """Raw writes, on one of the pool's connections per batch: the enqueue is on every request's way to its
        first token."""
        self.scheduler = scheduler
        self.batch: list[_Put] = []
        self.writer: asyncio.Task[None] | None = None

    async def put(self, job: bus.Job, record: Record | None = None) -> fairshare.Admitted:
        """Enqueues a job; `record` (key, value, ttl in ms) is written with it, before it (and removed again if
        the job is refused)."""
        written: asyncio.Future[fairshare.Admitted] = asyncio.get_running_loop().create_future()
        self.batch.append(_Put(job, bus.encode_job(job), record, written))
        if self.writer is None or self.writer.done():
            # it runs once the requests that arrived with this one have queued their jobs too
            self.writer = asyncio.create_task(self._write_batches(), name="job-queue")
        return await written

    async def _write_batches(self) -> None:
        while self.batch:
            batch, self.batch = self.batch, []
            outcomes = await self._write(batch)
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

    async def _write(self, batch: list[_Put]) -> list[Outcome]:
        """One pipeline for the batch; per job, its outcome (the first failure of its commands, if any)."""
        pipe = self.pipelines.pipeline()
        for put in batch:
            if put.record is not None:
                pipe.execute_command("SET", put.record[0], put.record[1], "PX", put.record[2])
            self.scheduler.enqueue(pipe, put.job, put.encoded)
        commands = len(pipe)  # a failed execute empties the pipeline
        try:
            results = iter(await pipe.execute(raise_on_error=False))
        except (RedisError, OSError) as exc:
            failure = exc if isinstance(exc, RedisError) else RedisConnectionError(str(exc))
            results = iter([failure] * commands)
        outcomes: list[Outcome] = []
        for put in batch:
            mine = [next(results)] if put.record is None else [next(results), next(results)]
            failed = next((r for r in mine if isinstance(r, Exception)), None)
            outcomes.append(failed if failed is not None else fairshare.outcome(mine[-1]))
        return outcomes

    def _resolve(self, put: _Put, outcome: Outcome) -> bool:
        """Settles a put's future; True if admission refused the job."""
        if isinstance(outcome, fairshare.Admitted):
            metrics.EDGE_DISPATCHES.labels(put.job.model).inc(outcome.dispatched)
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
        except (RedisError, OSError) as exc:
            failure = exc if isinstance(exc, RedisError) else RedisConnectionError(str(exc))
            for put in puts:
                self._resolve(put, failure)
            return
        for put in puts:
            put.retried = True
        self.batch[:0] = puts

    async def _forget(self, records: list[str]) -> None:
        """Removes the resume records of refused jobs: there is nothing to resume."""
        with contextlib.suppress(RedisError, OSError):
            pipe = self.redis.pipeline(transaction=False)
            for key in records:
                pipe.delete(key)
            await pipe.execute()
