"""A worker, composed: its clients, its job table, the runner that owns each job to its settlement, the intake
that brings jobs in and the upkeep that keeps them its own; `start()` and `stop()` bracket its life (a stop hands
what still runs over to other workers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from services.worker.intake import Intake
from services.worker.jobrun import Engine, JobRunner
from services.worker.jobtable import JobTable
from services.worker.ownership import Ownership
from services.worker.prefix_summary import PrefixSummary
from services.worker.publisher import EventPublisher
from services.worker.scheduling import SchedulerLink
from services.worker.upkeep import Upkeep
from shared.protocol import keys
from shared.redisio import clients as redis_clients
from shared.runtime import metrics
from shared.runtime.background import cancel_and_wait
from shared.runtime.settings import Settings, engine_seqs
from shared.tenancy import fairshare

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0
"""How long a stopping worker waits for each of its loops and clients to close after the drain."""
HANDOVER_WAIT_S = 5.0
"""How long a draining worker waits for the jobs it hands over to stop in the engine."""


class Worker:
    """Serves one model from its request stream; `start()` and `stop()` bracket its life."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.model = settings.model
        metrics.worker_series(self.model)
        self.stream = keys.requests_stream(settings.model)
        self.jobs = JobTable(engine_seqs(settings))
        self.crashed = asyncio.Event()
        """Set when a loop the worker cannot live without died: the process should exit and be restarted."""
        # bounded: a burst of jobs waits for a connection instead of opening hundreds; the pull and the
        # cancel subscription hold one each for good
        name = f"tokenbus-worker-{self.id}"
        access = redis_clients.access_of(settings)
        self.redis = redis_clients.pooled(settings.redis_url, name, settings.redis_pool_size + 1,
                                          settings.redis_cluster, access)
        channels = redis_clients.dedicated(settings.redis_url, name, settings.redis_cluster, access)
        self.scheduler = SchedulerLink(
            fairshare.for_settings(self.redis, settings), self.model,
            fairshare.Offer.of(self.id, settings))
        self.publisher = EventPublisher(redis_clients.dedicated(settings.redis_url, name, settings.redis_cluster,
                                                                access),
                                        settings.replay_max_events, after_acks=self.scheduler)
        self.ownership = Ownership(self.redis, self.id, self.model, self.stream, keys.WORKER_GROUP,
                                   aware=settings.dispatch == "aware")
        self.prefixes = PrefixSummary(self.model, self.id,
                                      settings.prefix_summary_size if settings.task == "generate" else 0,
                                      int(settings.heartbeat_ttl_s * 1000), engine.cache_tokens)
        self.runner = JobRunner(settings, engine, self.id, self.jobs, self.publisher, self.redis, self.prefixes)
        self.runner.on_engine_died = self._engine_died
        self.intake = Intake(settings, engine, self.id, self.jobs, self.runner, self.publisher, self.scheduler,
                             self.ownership, self.redis)
        self.upkeep = Upkeep(settings, engine, self.id, self.jobs, self.runner, self.intake, self.scheduler,
                             self.ownership, self.redis, channels, self.prefixes)
        self.tasks: list[asyncio.Task[None]] = []
        self.puller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.intake.ensure_group()
        self.tasks = [
            self._vital(self.publisher.run(), "publisher"),
            self._vital(self.upkeep.listen(), "channels"),
            self._vital(self.upkeep.heartbeat(), "heartbeat"),
            self._vital(self.upkeep.supervise(), "supervise"),
        ]
        self.puller = self._vital(self.intake.pull(), "pull")
        log.info("worker %s serves %s from %s", self.id, self.model, self.stream)

    def _vital(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A loop that must never end: if it dies, the worker says so and asks to be restarted."""
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(self._check_vital)
        return task

    def _engine_died(self) -> None:
        """The engine can serve no more (vLLM's engine core died): the worker stops taking jobs, hands over those
        it has and exits non-zero, to be restarted."""
        if not self.crashed.is_set():
            log.critical("the engine died: handing its jobs over to other workers, then exiting")
            self.crashed.set()

    def _check_vital(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.critical("the worker's %s loop died: %r", task.get_name(), task.exception())
            self.crashed.set()

    async def stop(self) -> None:
        """Stops pulling, lets running jobs finish for a grace period, hands the rest over. Idempotent."""
        if self.puller is None:
            return
        self.upkeep.stopping = True
        self.puller.cancel()
        self.puller = None
        with contextlib.suppress(RedisError, OSError):
            await self.scheduler.withdraw()
            await self.ownership.rescue(int(self.settings.heartbeat_ttl_s * 1000))  # what it never read goes back
        if self.jobs.tasks:
            grace = 0.0 if self.engine.dead() else self.settings.worker_grace_s  # a dead engine finishes none
            log.info("waiting up to %.0f s for %d running jobs", grace, len(self.jobs.tasks))
            _done, late = await asyncio.wait(list(self.jobs.tasks.values()), timeout=grace)
            if late:
                await self._hand_over_running()
        await self.publisher.drain(timeout_s=5.0)
        with contextlib.suppress(RedisError, OSError):
            await self.upkeep.forget()
        reloading = [self.scheduler.reloading] if self.scheduler.reloading is not None else []
        await cancel_and_wait([*self.tasks, *reloading])  # one that does not end is named, rather than hang the stop
        for client in (self.redis, self.upkeep.channels, self.publisher.redis):
            # RuntimeError: redis-py's cluster client, after a transaction, fails to close that connection
            with contextlib.suppress(TimeoutError, RedisError, OSError, RuntimeError):
                async with asyncio.timeout(STOP_WAIT_S):
                    await client.aclose()
        log.info("worker %s stopped", self.id)

    async def _hand_over_running(self) -> None:
        """Stops the jobs still running and puts them back on the queue to continue on another worker."""
        runs = self.jobs.all()
        for run in runs:
            run.let_go()
            await self.engine.abort(run.job.id)
        self.runner.handing_over.set()  # what a dead engine failed waits for this
        tasks = [self.jobs.tasks[r.job.id] for r in runs if r.job.id in self.jobs.tasks]
        _done, stuck = await asyncio.wait(tasks, timeout=HANDOVER_WAIT_S) if tasks else (set(), set())
        for task in stuck:
            task.cancel()
        await self.publisher.drain(timeout_s=5.0)  # the log holds everything its clients can have
        handed = 0
        for run in runs:
            try:
                placed = await self.ownership.hand_over(run)
            except (RedisError, OSError) as exc:  # its entry stays pending: a live worker reclaims it
                log.warning("could not hand job %s over (%s); it will be reclaimed", run.job.id, exc)
                continue
            if placed is None:  # a worker that found it idle claimed it meanwhile, and continues it
                log.info("job %s was claimed by another worker before it was handed over", run.job.id)
                continue
            handed += 1
            metrics.HANDOVERS.labels(self.model).inc()
            placed.count(self.model, metrics.DISPATCHES, metrics.DISPATCH_DECISIONS)
        log.info("handed %d running jobs over to other workers", handed)
