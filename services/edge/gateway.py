"""The edge's side of the bus: enqueue jobs, cancel them, and know which models have live workers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.edge.directory import ModelDirectory
from services.edge.enqueue import JobQueue
from services.edge.relay import EventRelay, JobEvents
from shared import bus, keys
from shared.errors import InvalidRequest, ModelNotFound, Overloaded

log = logging.getLogger(__name__)

CANCEL_MARK_TTL_S = 3600


class Gateway:
    """Submits jobs and yields their events; every call has a deadline."""

    def __init__(self, redis: aioredis.Redis, relay: EventRelay, directory: ModelDirectory) -> None:
        self.redis = redis
        self.relay = relay
        self.directory = directory
        self.queue = JobQueue(redis)

    @contextlib.asynccontextmanager
    async def submit(self, job: bus.Job, deadline: float) -> AsyncIterator[JobEvents]:
        """Enqueues the job; the block reads its events. Leaving early cancels the job."""
        events = self.relay.register(job.id, deadline)
        try:
            try:
                await self.queue.put(keys.requests_stream(job.model), bus.encode_job(job))
            except RedisError as exc:
                raise Overloaded("The request queue is unavailable; try again.") from exc
            try:
                yield events
            finally:
                if not events.finished:
                    await self.cancel(job.id)
        finally:
            self.relay.unregister(job.id)

    async def cancel(self, job_id: str) -> None:
        """Marks the job cancelled (for a worker yet to pick it up) and tells running workers."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(keys.cancelled(job_id), 1, ex=CANCEL_MARK_TTL_S)
            pipe.publish(keys.CANCEL_CHANNEL, job_id)
            await pipe.execute()
        except RedisError as exc:
            log.warning("could not cancel job %s: %s", job_id, exc)

    async def find_model(self, model: str) -> bus.WorkerInfo:
        """The heartbeat of a live worker of the model; a 404 if there is none."""
        try:
            info = await self.directory.find(model)
        except RedisError as exc:
            raise Overloaded("The service cannot reach its queue; try again.") from exc
        if info is None:
            raise ModelNotFound(f"The model `{model}` does not exist or has no live worker.", param="model")
        return info

    async def require_model(self, model: str, task: str = "generate") -> bus.WorkerInfo:
        """Like find_model, and a 400 if the model serves another task."""
        info = await self.find_model(model)
        if info.task != task:
            what = {"generate": "text generation", "embed": "embeddings"}
            raise InvalidRequest(f"The model `{model}` serves {what.get(info.task, info.task)}, not "
                                 f"{what.get(task, task)}.", param="model", code="wrong_model_task")
        return info
