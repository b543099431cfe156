"""Puts jobs on their models' request streams: the jobs of every request that arrives in the same instant
go out in one pipelined write, so a burst of requests costs the edge one round trip, not one each."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from shared import bus

Record = tuple[str, bytes, int]
"""A key written with a job: (key, value, time to live in ms)."""


class JobQueue:
    """`put` returns once the job is on its stream; it raises RedisError if it could not be written."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.batch: list[tuple[str, bytes, Record | None, asyncio.Future[None]]] = []
        self.writer: asyncio.Task[None] | None = None

    async def put(self, stream: str, job: bytes, record: Record | None = None) -> None:
        """Enqueues a job; `record` (key, value, ttl in ms) is written with it, before it."""
        written = asyncio.get_running_loop().create_future()
        self.batch.append((stream, job, record, written))
        if self.writer is None or self.writer.done():
            # it runs once the requests that arrived with this one have queued their jobs too
            self.writer = asyncio.create_task(self._write_batches(), name="job-queue")
        await written

    async def _write_batches(self) -> None:
        while self.batch:
            batch, self.batch = self.batch, []
            pipe = self.redis.pipeline(transaction=False)
            for stream, job, record, _written in batch:
                if record is not None:
                    pipe.set(record[0], record[1], px=record[2])
                pipe.xadd(stream, {bus.JOB_FIELD: job})
            commands = len(pipe)  # a failed execute empties the pipeline
            try:
                results = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError) as exc:
                failure = exc if isinstance(exc, RedisError) else RedisConnectionError(str(exc))
                results = [failure] * commands
            outcomes = iter(results)
            for _stream, _job, record, written in batch:
                result = next(outcomes) if record is None else _first_failure(next(outcomes), next(outcomes))
                if written.done():  # its request went away meanwhile (its job is cancelled on the way out)
                    continue
                if isinstance(result, Exception):
                    written.set_exception(result)
                else:
                    written.set_result(None)


def _first_failure(*results: object) -> object:
    return next((r for r in results if isinstance(r, Exception)), results[-1])
