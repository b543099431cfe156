"""A worker's side of the fair-share scheduler (shared.tenancy.fairshare): it offers its slots and dispatches before it
reads jobs, and settles each finished job's charge in the same write that acknowledges the job, followed by a
dispatch into the slot it freed, so the next job is on its way without another round trip."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from shared.protocol import keys
from shared.redisio.rawpipe import PipelineLike
from shared.runtime import metrics
from shared.tenancy import fairshare

log = logging.getLogger(__name__)


class SchedulerLink:
    """Offers `slots` of one worker to its model's scheduler; the publisher's AckFollowup."""

    def __init__(self, scheduler: fairshare.Scheduler, model: str, offer: fairshare.Offer) -> None:
        self.scheduler = scheduler
        self.model = model
        self.offer = offer
        self.failing = False
        """The last call failed: the next failure is not logged again."""
        self.reloading: asyncio.Task[None] | None = None
        """The scripts' reload after Redis lost them (see renewed), while it runs."""

    async def dispatch(self) -> None:
        """Offers the worker's slots (renewing the offer) and fills the room on the request stream. A failure is
        logged, never raised: the worker's loops go on, and the next call tries again."""
        try:
            moved = await self.scheduler.dispatch(self.model, self.offer)
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return
        self._dispatched(moved)

    def renew(self, pipe: PipelineLike) -> None:
        """Adds the dispatch (the offer's renewal) to another write, such as the worker's heartbeat."""
        self.scheduler.offer(pipe, self.model, self.offer)

    def renewed(self, result: Any) -> None:
        """Takes the result of `renew`'s command; a Redis that lost the scripts (or never had them) gets them all
        again, and the dispatch, off the heartbeat that renewed (a slow reload must not let it lapse)."""
        if isinstance(result, NoScriptError):
            if self.reloading is None or self.reloading.done():
                self.reloading = asyncio.create_task(self._reload(), name="scheduler-reload")
        elif isinstance(result, Exception):
            self._failed(result)
        else:
            self._dispatched(fairshare.Dispatched.of(result))

    async def _reload(self) -> None:
        try:
            await self.scheduler.load()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return
        await self.dispatch()

    def _failed(self, exc: Exception) -> None:
        if not self.failing:
            log.warning("the scheduler's dispatch failed (%s); the worker keeps trying", exc)
        self.failing = True

    def _dispatched(self, moved: fairshare.Dispatched) -> None:
        self.failing = False
        moved.count(self.model, metrics.DISPATCHES, metrics.DISPATCH_DECISIONS)

    def read_backlog(self, pipe: PipelineLike) -> None:
        """Adds the reads of the model's queue to another write, such as the worker's heartbeat; `count` takes
        their replies."""
        self.scheduler.read_backlog(pipe, self.model)

    def count(self, replies: list[Any]) -> None:
        """Updates the gauges of the model's queue: its queued jobs, and its request streams' length, lag and
        entries pending with workers."""
        backlog = fairshare.Backlog.of(replies)
        metrics.QUEUED_JOBS.labels(self.model).set(backlog.queued)
        metrics.STREAM_LENGTH.labels(self.model).set(backlog.length)
        metrics.STREAM_PENDING.labels(self.model).set(backlog.pending)
        metrics.STREAM_LAG.labels(self.model).set(backlog.lag)

    async def withdraw(self) -> None:
        """Takes the worker's offer back (it stops taking jobs)."""
        await self.scheduler.redis.hdel(keys.fair_key(self.model, "slots"), self.offer.worker)

    def queue(self, pipe: PipelineLike, notes: list[Any]) -> None:
        self.scheduler.settle(pipe, self.model, notes)

    def done(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, Exception):
                log.warning("settling finished jobs with the scheduler failed (%s)", result)
            else:
                moved = fairshare.Dispatched.of(result)
                moved.count(self.model, metrics.DISPATCHES, metrics.DISPATCH_DECISIONS)

