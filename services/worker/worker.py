"""The worker's lifecycle: pull jobs while slots are free, run them, publish events, obey cancels, keep its
claims, take over the jobs of dead workers, and hand its own over when it drains."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError, ResponseError

from services.worker.jobrun import Engine, JobRunner
from services.worker.jobtable import JobTable, Run
from services.worker.ownership import Ownership
from services.worker.parsing.output import for_job
from services.worker.publisher import EventPublisher
from services.worker.scheduling import SchedulerLink
from shared.protocol import bus, keys
from shared.protocol.errors import QueueTimeout, WorkerLost
from shared.redisio import clients as redis_clients
from shared.redisio import rawpipe
from shared.runtime import logs, metrics
from shared.runtime.settings import Settings, engine_seqs
from shared.tenancy import fairshare

log = logging.getLogger(__name__)

PULL_BLOCK_MS = 5000
"""A job's arrival ends the read at once; the block only sets how often an idle worker asks again (within the
10 s deadline of a Redis call)."""
STOP_WAIT_S = 5.0
"""How long a stopping worker waits for each of its loops and clients to close after the drain."""
HANDOVER_WAIT_S = 5.0
"""How long a draining worker waits for the jobs it hands over to stop in the engine."""
FORGET_CONSUMERS_EVERY = 10
"""Supervision rounds between two sweeps for dead consumers of the group."""
CHECK_FIRST_AFTER_MS = 1000
"""A job that waited in the queue longer than this is checked for a cancel before it starts. A younger one
starts at once, off the time-to-first-token path, and is aborted if the check finds it cancelled: a cancel
sent while it waits also reaches the worker on the cancel channel."""
CHECK_WAIT_S = 5.0
"""How long an older job waits for that check (it rides the publisher's next write, which waits out a Redis
outage): past it the job starts, and the check's answer, when it comes, still aborts it or routes its events."""


@dataclass(frozen=True)
class _Check:
    """What a job's marks say: a cancel, or an edge that resumed it elsewhere (read when a fresh job starts, and for
    the running ones after the subscription that brings cancels and routes was down)."""

    cancelled: bool
    reply_to: str | None

    @staticmethod
    def commands(job_ids: list[str]) -> list[tuple[rawpipe.Arg, ...]]:
        """The reads of the jobs' marks, two per job; `read` takes their replies."""
        return [command for job_id in job_ids
                for command in (("EXISTS", keys.cancelled(job_id)), ("GET", keys.job_reply_to(job_id)))]

    @classmethod
    def read(cls, replies: list[Any]) -> list[_Check]:
        return [cls(bool(cancelled), reply_to.decode() if reply_to else None)
                for cancelled, reply_to in zip(replies[::2], replies[1::2], strict=True)]


def _answer(checks: asyncio.Future[list[_Check]], index: int) -> _Check | None:
    """What a batch's check found for one of its jobs; None while it has no answer (not written yet, or failed)."""
    if not checks.done() or checks.cancelled() or checks.exception() is not None:
        return None
    return checks.result()[index]


@dataclass
class _RoundReads:
    """The reads of one supervision round, which ride a heartbeat's write: each a named span of that write, whose
    replies are taken by name once it is back."""

    runs: list[Run]
    """The runs whose claims are refreshed."""
    streams: list[str]
    """The edges' streams of attached runs, whose edges' liveness is read."""
    claims: int
    """Entries of dead workers to claim at most (free slots); 0 reads none."""
    backlog: rawpipe.Span
    """The reads of the model's queue, for its gauges."""
    refresh: rawpipe.Span
    """The refresh of the runs' claims (none without runs)."""
    alive: rawpipe.Span
    """One liveness read per stream of `streams`."""
    claim: rawpipe.Span
    """The claim of dead workers' entries (none when `claims` is 0)."""
    replies: list[Any] = field(default_factory=list)
    """The whole write's replies, the heartbeat's own included."""


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
        self.stopping = False
        self.crashed = asyncio.Event()
        """Set when a loop the worker cannot live without died: the process should exit and be restarted."""
        # bounded: a burst of jobs waits for a connection instead of opening hundreds; the pull and the
        # cancel subscription hold one each for good
        name = f"tokenbus-worker-{self.id}"
        access = redis_clients.access_of(settings)
        self.redis = redis_clients.pooled(settings.redis_url, name, settings.redis_pool_size + 1,
                                            settings.redis_cluster, access)
        self.channels = redis_clients.dedicated(settings.redis_url, name, settings.redis_cluster, access)
        """The cancel and route subscription: quiet for long stretches, so no socket timeout."""
        self.scheduler = SchedulerLink(
            fairshare.for_settings(self.redis, settings), self.model,
            fairshare.Offer.of(self.id, settings))
        self.publisher = EventPublisher(redis_clients.dedicated(settings.redis_url, name, settings.redis_cluster,
                                                                access),
                                        settings.replay_max_events, after_acks=self.scheduler)
        self.beats = rawpipe.Pipelines(self.redis, keep=False)
        """The heartbeat's write, with the offer's renewal and a supervision round's reads: one round trip a beat,
        raw (redis-py's pipeline costs an idle worker more CPU than everything else it does)."""
        self.round_read: asyncio.Queue[_RoundReads] = asyncio.Queue(maxsize=1)
        self.claims_after = 0.0
        """No claims before this time (monotonic): after an outage every entry has grown idle, and the entries of
        live workers must not be taken before their owners have had a heartbeat's TTL to refresh them."""
        self.pulls = rawpipe.Pipelines(self.redis)
        """The pull's blocking read, raw on a connection it holds for good: it is on every job's way to the
        engine, and redis-py converts each reply and checks a connection out of its pool in Python."""
        self.ownership = Ownership(self.redis, self.id, self.model, self.stream, keys.WORKER_GROUP)
        self.runner = JobRunner(settings, engine, self.id, self.jobs, self.publisher, self.redis)
        self.tasks: list[asyncio.Task[None]] = []
        self.puller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._ensure_group()
        self.tasks = [
            self._vital(self.publisher.run(), "publisher"),
            self._vital(self._listen(), "channels"),
            self._vital(self._heartbeat(), "heartbeat"),
            self._vital(self._supervise(), "supervise"),
        ]
        self.puller = self._vital(self._pull(), "pull")
        log.info("worker %s serves %s from %s", self.id, self.model, self.stream)

    def _vital(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A loop that must never end: if it dies, the worker says so and asks to be restarted."""
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(self._check_vital)
        return task

    def _check_vital(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.critical("the worker's %s loop died: %r", task.get_name(), task.exception())
            self.crashed.set()

    async def stop(self) -> None:
        """Stops pulling, lets running jobs finish for a grace period, hands the rest over. Idempotent."""
        if self.puller is None:
            return
        self.stopping = True
        self.puller.cancel()
        self.puller = None
        with contextlib.suppress(RedisError, OSError):
            await self.scheduler.withdraw()
        if self.jobs.tasks:
            grace = self.settings.worker_grace_s
            log.info("waiting up to %.0f s for %d running jobs", grace, len(self.jobs.tasks))
            _done, late = await asyncio.wait(list(self.jobs.tasks.values()), timeout=grace)
            if late:
                await self._hand_over_running()
        await self.publisher.drain(timeout_s=5.0)
        with contextlib.suppress(RedisError, OSError):
            heartbeat = keys.worker_heartbeat(self.model, self.id)
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(heartbeat)
            pipe.zrem(keys.WORKERS, heartbeat)
            await pipe.execute()
        for task in self.tasks:
            task.cancel()
        _stopped, stuck = await asyncio.wait(self.tasks, timeout=STOP_WAIT_S) if self.tasks else (set(), set())
        if stuck:  # say which, rather than hang the shutdown
            log.warning("loops still running %.0f s after their cancel: %s", STOP_WAIT_S,
                        ", ".join(sorted(task.get_name() for task in stuck)))
        for client in (self.redis, self.channels, self.publisher.redis):
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
        tasks = [self.jobs.tasks[r.job.id] for r in runs if r.job.id in self.jobs.tasks]
        _done, stuck = await asyncio.wait(tasks, timeout=HANDOVER_WAIT_S) if tasks else (set(), set())
        for task in stuck:
            task.cancel()
        await self.publisher.drain(timeout_s=5.0)  # the log holds everything its clients can have
        for run in runs:
            try:
                await self.ownership.hand_over(run.entry_id, run.job, run.ticket.fields() if run.ticket else None)
                metrics.HANDOVERS.labels(self.model).inc()
            except (RedisError, OSError) as exc:  # its entry stays pending: a live worker reclaims it
                log.warning("could not hand job %s over (%s); it will be reclaimed", run.job.id, exc)
        log.info("handed %d running jobs over to other workers", len(runs))

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, keys.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _pull(self) -> None:
        """Reads jobs into free slots. The scheduler's dispatch fills the request stream at the first read (this
        worker's slots join the offer); after that an edge's enqueue, the settle written with each finished job's
        ack and the heartbeat's offer renewal dispatch, so an idle read costs no script call."""
        await self.scheduler.dispatch()
        while True:
            free = self.jobs.free_slots()
            if free <= 0:
                await self.jobs.until_a_job_ends()
                continue
            try:
                pipe = self.pulls.pipeline()
                pipe.execute_command("XREADGROUP", "GROUP", keys.WORKER_GROUP, self.id, "COUNT", free,
                                     "BLOCK", PULL_BLOCK_MS, "STREAMS", self.stream, ">")
                reply = (await pipe.execute())[0]
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._ensure_group()  # Redis lost its data (a restart without persistence)
                continue
            except (RedisError, OSError) as exc:
                log.warning("reading jobs failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            if entries := [(entry_id, rawpipe.field_map(fields)) for entry_id, fields in rawpipe.stream_entries(reply)]:
                self._accept(entries)
            await asyncio.sleep(0)  # the jobs just accepted reach the engine before the next pull is sent

    def _decode(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Run]:
        """A run for each well-formed entry; a malformed one is dropped."""
        jobs: list[Run] = []
        for entry_id, fields in entries:
            try:
                jobs.append(Run(bus.decode_job(fields[bus.JOB_FIELD]), entry_id, fairshare.Ticket.from_fields(fields)))
            except (KeyError, ValueError) as exc:
                log.error("dropping malformed job entry %s: %s", entry_id, type(exc).__name__)
                self.publisher.ack_after(self.stream, keys.WORKER_GROUP, entry_id)
        return jobs

    def _accept(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Starts a batch of jobs; one lookup, in the publisher's next write, tells which were cancelled or resumed
        while they waited."""
        runs = self._decode(entries)
        fresh = [run for run in runs if not run.job.handovers]
        for run in runs:
            if run.job.handovers:
                self._start(run, self._take_over(run, reclaimed=False))
        if not fresh:
            return
        # registered before the check, so that a cancel published meanwhile finds them; their tasks, made first,
        # reach the engine (and publish their first events, which the check's write carries) before it is sent
        checks: asyncio.Future[list[_Check]] = asyncio.get_running_loop().create_future()
        for i, run in enumerate(fresh):
            self._start(run, self._run_fresh(run, checks, i))
        self._check([run.job.id for run in fresh], checks)

    def _start(self, run: Run, work: Coroutine[Any, Any, None]) -> None:
        self.jobs.add(run, asyncio.create_task(self.runner.own(run, work), name=f"job-{run.job.id}"))

    def _check(self, job_ids: list[str], checks: asyncio.Future[list[_Check]]) -> None:
        """Asks whether each job was cancelled, or resumed on another edge, while it waited: in the publisher's
        next write (with the first events of the jobs), not in a round trip of its own."""
        def found(replies: list[Any]) -> None:
            if checks.done():
                return
            if failed := next((reply for reply in replies if isinstance(reply, Exception)), None):
                checks.set_exception(failed)  # the runs waiting on it see the failure
                return
            checks.set_result(_Check.read(replies))

        self.publisher.then(_Check.commands(job_ids), found)

    def _apply_check(self, run: Run, index: int, checks: asyncio.Future[list[_Check]]) -> None:
        if (check := _answer(checks, index)) is None:
            return
        if check.reply_to:
            run.job.reply_to = check.reply_to
        if check.cancelled:
            self.runner.in_background(self.abort(run.job.id))

    async def _run_fresh(self, run: Run, checks: asyncio.Future[list[_Check]], index: int) -> None:
        job = run.job
        waited_ms = bus.now_ms() - job.created_ms
        cancelled = job.id in self.jobs.aborted
        if not cancelled and waited_ms > CHECK_FIRST_AFTER_MS:
            await asyncio.wait([checks], timeout=CHECK_WAIT_S)
            cancelled = (answer := _answer(checks, index)) is not None and answer.cancelled
        if cancelled:
            metrics.JOBS.labels(self.model, "cancelled").inc()  # its client left while it was queued
            return
        tenant = self.runner.tenants.label(run.job.tenant)
        metrics.QUEUE_WAIT.labels(self.model, tenant).observe(max(0, waited_ms) / 1000)
        if job.created_ms and waited_ms > self.settings.queue_timeout_s * 1000:
            await asyncio.wait([checks], timeout=CHECK_WAIT_S)  # it may have been resumed on another edge meanwhile
            self._apply_check(run, index, checks)
            self.runner.end_with(run, QueueTimeout(
                f"The request waited {waited_ms / 1000:.0f} s for a worker, longer than the queue timeout "
                f"({self.settings.queue_timeout_s:g} s); it was not started."))
            metrics.JOBS.labels(self.model, "queue_timeout").inc()
            return
        checks.add_done_callback(lambda done: self._apply_check(run, index, done))
        await self.runner.serve(run, resumed=False)

    async def _take_over(self, run: Run, reclaimed: bool) -> None:
        """Runs a job another worker began: after what its log holds, under a new epoch."""
        job = run.job
        keep_s = (job.deadline_ms - bus.now_ms()) / 1000 + self.settings.replay_ttl_s
        taken = await self.ownership.take_over(job, reclaimed, keep_s)
        run.epoch, run.next_seq, job.reply_to = taken.epoch, taken.next_seq, taken.reply_to
        if taken.cancelled or taken.ended:
            metrics.JOBS.labels(self.model, "cancelled" if taken.cancelled else "finished").inc()
            return
        if taken.reclaims > self.settings.max_reclaims:
            await self._dead_letter(run, f"{taken.reclaims} workers died running it")
            return
        if taken.conflict:
            self.runner.end_with(run, WorkerLost("The job's worker was lost and its stream cannot be continued."))
            metrics.JOBS.labels(self.model, "lost").inc()
            return
        if not self._can_continue(run, taken.continuation):
            metrics.JOBS.labels(self.model, "lost").inc()
            return
        job.continuation = taken.continuation
        metrics.MIGRATIONS.labels(self.model, "reclaimed" if reclaimed else "handed_over").inc()
        log.info("continuing job %s after %d events (epoch %d)", job.id, run.next_seq, run.epoch)
        await self.runner.serve(run, resumed=True)

    def _can_continue(self, run: Run, continuation: bus.Continuation | None) -> bool:
        """Whether the job can go on after what a former owner generated; if not, it ends with worker_lost."""
        if continuation is None or not continuation.carried():
            return True
        job = run.job
        if job.params.constraint is not None:
            # the engine would start the grammar over in the middle of the answer: never unconstrained output
            self.runner.end_with(run, WorkerLost("The job's worker was lost, and a structured output cannot "
                                                 "continue on another worker; send the request again."))
            return False
        run.output = for_job(job, self.runner.tool_format, self.runner.reasoning)
        if run.output is not None and not run.output.resume(continuation, lambda ids: self.engine.decode(job, ids)):
            self.runner.end_with(run, WorkerLost("The job's worker was lost, and its tool calls cannot be "
                                                 "continued faithfully on another worker; send the request again."))
            return False
        return True

    async def _dead_letter(self, run: Run, reason: str) -> None:
        await self.ownership.dead_letter(run.entry_id, run.job, reason)
        run.give_up()
        self.runner.end_with(run, WorkerLost(f"The job was given up: {reason}."))
        metrics.DEAD_LETTERS.labels(self.model).inc()
        metrics.JOBS.labels(self.model, "dead_letter").inc()
        log.warning("job %s went to the dead-letter stream: %s", run.job.id, reason)

    async def abort(self, job_id: str, abandoned: bool = False) -> None:
        """Aborts a running job in the engine; its generator then ends by itself."""
        if (run := self.jobs.abort(job_id, abandoned)) is None:
            return
        await self.engine.abort(job_id)
        metrics.ENGINE_ABORTS.labels(self.model).inc()
        with logs.about(run.job.request_id or job_id):
            log.info("aborted job %s in the engine: its client went away", job_id)

    async def _listen(self) -> None:
        while True:
            pubsub = None
            try:
                pubsub = await redis_clients.subscriber(self.channels)
                await pubsub.subscribe(keys.CANCEL_CHANNEL, keys.ROUTE_CHANNEL)
                if self.jobs:
                    await self._catch_up_on_messages()
                async for message in pubsub.listen():
                    if message["channel"] == keys.ROUTE_CHANNEL.encode():
                        self.jobs.route(bus.decode_route(message["data"]))
                    else:
                        await self.abort(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()

    async def _catch_up_on_messages(self) -> None:
        """What the cancels and routes published while the subscription was down would have said to the running
        jobs (they reached nobody): read from the marks their senders leave, once subscribed again."""
        runs = self.jobs.all()
        pipe = self.redis.pipeline(transaction=False)
        for command in _Check.commands([run.job.id for run in runs]):
            pipe.execute_command(*command)
        for run, check in zip(runs, _Check.read(await pipe.execute()), strict=True):
            if check.reply_to and check.reply_to != run.job.reply_to:
                self.jobs.route(bus.Route(job=run.job.id, reply_to=check.reply_to))
            if check.cancelled:
                await self.abort(run.job.id)

    async def _heartbeat(self) -> None:
        """Every heartbeat interval, one round trip: the heartbeat, the renewal of the scheduler's offer, and the
        reads of a supervision round, whose replies go to `_supervise`. Acting on them is left to that task: a
        slow round must not hold up the heartbeat."""
        key = keys.worker_heartbeat(self.model, self.id)
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        while True:
            info = bus.encode_info(bus.WorkerInfo(
                worker=self.id, model=self.model, task=self.settings.task,
                max_model_len=self.engine.max_model_len, dimensions=self.engine.dimensions,
                slots=self.settings.max_num_seqs, running=self.jobs.slots.used,
            ))
            pipe = self.beats.pipeline()
            with rawpipe.Span(pipe) as beat:
                pipe.execute_command("SET", key, info, "PX", ttl_ms)
                pipe.execute_command("ZADD", keys.WORKERS, time.time() + self.settings.heartbeat_ttl_s, key)
            with rawpipe.Span(pipe) as renewal:
                if not self.stopping:  # a full worker pulls nothing, but its offer must not lapse
                    self.scheduler.renew(pipe)
            reads = self._read_round(pipe)
            try:
                results = await pipe.execute(raise_on_error=False)
                if failed := next((r for r in beat.of(results) if isinstance(r, Exception)), None):
                    raise failed
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed (%s)", exc)
                self.claims_after = math.inf
            else:
                if self.claims_after == math.inf:
                    self.claims_after = time.monotonic() + self.settings.heartbeat_ttl_s
                if renewed := renewal.of(results):
                    await self.scheduler.renewed(renewed[0])
                reads.replies = results
                if not self.round_read.full():  # else the round before is still being acted on: this one waits
                    self.round_read.put_nowait(reads)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def _read_round(self, pipe: rawpipe.PipelineLike) -> _RoundReads:
        """Adds a supervision round's reads to the heartbeat's write: the queue's gauges, a refresh of our claims,
        whether the edges of attached jobs still beat, and a claim of dead workers' jobs into free slots."""
        runs = self.jobs.claimed()
        streams = self.jobs.attached_streams()
        claims = 0 if self._holding_claims() else max(0, self.jobs.free_slots())
        with rawpipe.Span(pipe) as backlog:
            self.scheduler.read_backlog(pipe)
        with rawpipe.Span(pipe) as refresh:
            if runs:
                self.ownership.read_refresh(pipe, [run.entry_id for run in runs])
        with rawpipe.Span(pipe) as alive:
            for stream in streams:
                pipe.execute_command("EXISTS", keys.edges_alive(stream))
        with rawpipe.Span(pipe) as claim:
            if claims:
                self.ownership.read_claim(pipe, int(self.settings.heartbeat_ttl_s * 1000), claims)
        return _RoundReads(runs, streams, claims, backlog, refresh, alive, claim)

    def _holding_claims(self) -> bool:
        return self.stopping or self.round_read.full() or time.monotonic() < self.claims_after

    async def _supervise(self) -> None:
        """Each heartbeat's supervision round: keep our claims, notice gone edges and clients, take over dead
        workers' jobs."""
        rounds = 0
        while True:
            reads = await self.round_read.get()
            rounds += 1
            try:
                await self._supervised(reads)
                if rounds % FORGET_CONSUMERS_EVERY == 0:
                    await self.ownership.forget_dead_consumers()
            except (RedisError, OSError) as exc:
                log.warning("supervision round failed (%s)", exc)

    async def _supervised(self, reads: _RoundReads) -> None:
        replies = reads.replies
        self.scheduler.count(reads.backlog.of(replies))
        if claim := reads.claim.of(replies):  # first: the entries are ours now, whatever fails below
            for run in self._decode(self.ownership.claimed(claim[0])):
                if run.job.id in self.jobs:  # ours, grown idle while Redis was away: the claim only refreshed it
                    continue
                metrics.RECLAIMS.labels(self.model).inc()
                log.info("claimed job %s from a worker that stopped beating", run.job.id)
                self._start(run, self._take_over(run, reclaimed=True))
        gone = {stream for stream, reply in zip(reads.streams, reads.alive.of(replies), strict=True) if reply == 0}
        self.jobs.detach(gone, bus.now_ms() + int(self.settings.resume_window_s * 1000))
        if refresh := reads.refresh.of(replies):
            lost = await self.ownership.lost(refresh[0], [run.entry_id for run in reads.runs])
            for run in reads.runs:
                if run.entry_id in lost:  # we stalled and another worker took it: stop without a word
                    log.warning("job %s was taken over by another worker; stopping it here", run.job.id)
                    run.let_go()
                    await self.engine.abort(run.job.id)
        await self._expire_detached()

    async def _expire_detached(self) -> None:
        now = bus.now_ms()
        for run in self.jobs.all():
            if run.keep_until_ms and now >= run.keep_until_ms:
                await self.abort(run.job.id, abandoned=True)

