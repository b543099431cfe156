"""The worker's lifecycle: pull jobs while slots are free, run them, publish events, obey cancels."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeVar

from redis.exceptions import RedisError, ResponseError

from services.worker.publisher import EventPublisher
from shared import bus, keys, metrics, redis_clients
from shared.errors import EngineError, RequestTimeout, TokenbusError, kind_of
from shared.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

PULL_BLOCK_MS = 1000
STOP_GRACE_S = 10.0
CHECK_FIRST_AFTER_MS = 1000
"""A job that waited in the queue longer than this is checked for a cancel before it starts. A younger one
starts at once, off the time-to-first-token path, and is aborted if the check finds it cancelled: a cancel
sent while it waits also reaches the worker on the cancel channel."""


class Engine(Protocol):
    """What the worker needs of an engine (vLLM, or a simulator for benchmarks and fault tests)."""

    max_model_len: int
    dimensions: int

    def run(self, job: bus.Job) -> AsyncIterator[bus.Output]: ...

    async def abort(self, job_id: str) -> None: ...


def error_event(job_id: str, error: TokenbusError) -> bus.Error:
    return bus.Error(job=job_id, kind=kind_of(error), message=error.message, param=error.param,
                     code=error.code)


class Worker:
    """Serves one model from its request stream; `start()` and `stop()` bracket its life."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.model = settings.model
        self.stream = keys.requests_stream(settings.model)
        self.running: dict[str, asyncio.Task[None]] = {}
        self.aborted: set[str] = set()
        self.slot_freed = asyncio.Event()
        # bounded: a burst of jobs waits for a connection instead of opening hundreds; the pull and the
        # cancel subscription hold one each for good
        name = f"tokenbus-worker-{self.id}"
        self.redis = redis_clients.pooled(settings.redis_url, name, settings.redis_pool_size + 2)
        self.publisher = EventPublisher(redis_clients.dedicated(settings.redis_url, name))
        self.tasks: list[asyncio.Task[None]] = []
        self.background: set[asyncio.Task[Any]] = set()
        """Cancel checks and the aborts they lead to, kept referenced until they end."""
        self.puller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._ensure_group()
        self.tasks = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self._listen_for_cancels(), name="cancels"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
        ]
        self.puller = asyncio.create_task(self._pull(), name="pull")
        log.info("worker %s serves %s from %s", self.id, self.model, self.stream)

    async def stop(self) -> None:
        """Stops pulling, lets running jobs finish for a grace period, aborts the rest. Idempotent."""
        if self.puller is None:
            return
        self.puller.cancel()
        self.puller = None
        with contextlib.suppress(RedisError):
            heartbeat = keys.worker_heartbeat(self.model, self.id)
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(heartbeat)
            pipe.zrem(keys.WORKERS, heartbeat)
            await pipe.execute()
        if self.running:
            log.info("waiting up to %.0f s for %d running jobs", STOP_GRACE_S, len(self.running))
            _done, late = await asyncio.wait(list(self.running.values()), timeout=STOP_GRACE_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.publisher.drain(timeout_s=5.0)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.redis.aclose()
        await self.publisher.redis.aclose()
        log.info("worker %s stopped", self.id)

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, keys.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _pull(self) -> None:
        while True:
            free = self.settings.max_num_seqs - len(self.running)
            if free <= 0:
                self.slot_freed.clear()
                await self.slot_freed.wait()
                continue
            try:
                reply: Any = await self.redis.xreadgroup(
                    keys.WORKER_GROUP, self.id, {self.stream: ">"}, count=free, block=PULL_BLOCK_MS
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._ensure_group()  # Redis lost its data (a restart without persistence)
                continue
            except (RedisError, OSError) as exc:
                log.warning("reading jobs failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in reply or ():
                self._accept(entries)
            await asyncio.sleep(0)  # the jobs just accepted reach the engine before the next pull is sent

    def _accept(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Starts a batch of jobs; one round trip tells which were cancelled while they waited."""
        jobs: list[tuple[bytes, bus.Job]] = []
        for entry_id, fields in entries:
            try:
                jobs.append((entry_id, bus.decode_job(fields[bus.JOB_FIELD])))
            except (KeyError, ValueError) as exc:
                log.error("dropping malformed job entry %s: %s", entry_id, type(exc).__name__)
                self.publisher.ack_after(self.stream, keys.WORKER_GROUP, entry_id)
        if not jobs:
            return
        # registered before the check, so that a cancel published meanwhile finds them
        cancelled = self._in_background(self._cancelled([job.id for _entry, job in jobs]))
        for i, (entry_id, job) in enumerate(jobs):
            self.running[job.id] = asyncio.create_task(self._run(job, entry_id, cancelled, i), name=f"job-{job.id}")

    def _in_background(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def _abort_if_cancelled(self, job_id: str, index: int, check: asyncio.Future[list[bool]]) -> None:
        if not check.cancelled() and check.exception() is None and check.result()[index]:
            self._in_background(self.abort(job_id))

    async def _cancelled(self, job_ids: list[str]) -> list[bool]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(keys.cancelled(job_id))
        return [bool(found) for found in await pipe.execute()]

    async def _run(self, job: bus.Job, entry_id: bytes, cancelled: asyncio.Future[list[bool]], index: int) -> None:
        outcome = "finished"
        try:
            waited_long = bus.now_ms() - job.created_ms > CHECK_FIRST_AFTER_MS
            if job.id in self.aborted or (waited_long and (await cancelled)[index]):
                outcome = "cancelled"  # its client left while it was queued: never start it
            else:
                cancelled.add_done_callback(functools.partial(self._abort_if_cancelled, job.id, index))
                outcome = await self._generate(job)
        except TokenbusError as exc:
            outcome = "rejected"
            self.publisher.publish(job.reply_to, error_event(job.id, exc))
        except Exception:
            outcome = "failed"
            log.exception("job %s failed in the engine", job.id)
            self.publisher.publish(job.reply_to, error_event(job.id, EngineError("The engine failed.")))
        finally:
            self.running.pop(job.id, None)
            self.aborted.discard(job.id)
            self.slot_freed.set()
            self.publisher.ack_after(self.stream, keys.WORKER_GROUP, entry_id)
            metrics.JOBS.labels(self.model, outcome).inc()

    async def _generate(self, job: bus.Job) -> str:
        remaining_s = (job.deadline_ms - bus.now_ms()) / 1000
        if remaining_s <= 0:
            raise RequestTimeout("The request expired while it waited in the queue.")
        running = metrics.RUNNING_JOBS.labels(self.model)
        running.inc()
        try:
            async with asyncio.timeout(remaining_s):
                async for event in self.engine.run(job):
                    if job.id in self.aborted:
                        # the cancel may have come before the engine knew the request: abort again
                        await self.engine.abort(job.id)
                        break
                    self.publisher.publish(job.reply_to, event)
                    if isinstance(event, bus.Tokens):
                        metrics.GENERATED_TOKENS.labels(self.model).inc(len(event.token_ids))
        except TimeoutError:
            await self.engine.abort(job.id)
            raise RequestTimeout("The request did not finish before its deadline.") from None
        finally:
            running.dec()
        return "aborted" if job.id in self.aborted else "finished"

    async def abort(self, job_id: str) -> None:
        """Aborts a running job in the engine; its generator then ends by itself."""
        if job_id not in self.running or job_id in self.aborted:
            return
        self.aborted.add(job_id)
        await self.engine.abort(job_id)
        metrics.ENGINE_ABORTS.labels(self.model).inc()
        log.info("aborted job %s in the engine: its client went away", job_id)

    async def _listen_for_cancels(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    await self.abort(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _heartbeat(self) -> None:
        key = keys.worker_heartbeat(self.model, self.id)
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        while True:
            info = bus.encode_info(bus.WorkerInfo(
                worker=self.id, model=self.model, task=self.settings.task,
                max_model_len=self.engine.max_model_len, dimensions=self.engine.dimensions,
                slots=self.settings.max_num_seqs, running=len(self.running),
            ))
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(key, info, px=ttl_ms)
                pipe.zadd(keys.WORKERS, {key: time.time() + self.settings.heartbeat_ttl_s})
                await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed (%s)", exc)
            await asyncio.sleep(self.settings.heartbeat_interval_s)
