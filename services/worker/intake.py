"""A worker's intake: jobs pulled into its free slots, decoded, checked for a cancel or a resume that came while
they waited, and started; and the jobs it takes over from other workers (handed over, or claimed from dead ones),
continued after what their log holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from services.worker.jobrun import Engine, JobRunner
from services.worker.jobtable import JobTable, Run
from services.worker.ownership import Ownership
from services.worker.parsing.output import for_job
from services.worker.publisher import EventPublisher
from services.worker.scheduling import SchedulerLink
from shared.protocol import bus, keys
from shared.protocol.errors import QueueTimeout, StreamAbandoned, WorkerLost
from shared.redisio import rawpipe
from shared.runtime import metrics
from shared.tenancy import fairshare

log = logging.getLogger(__name__)


class IntakeSettings(Protocol):
    """The settings the intake reads (Settings has them)."""

    @property
    def max_reclaims(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def queue_timeout_s(self) -> float: ...
    @property
    def replay_ttl_s(self) -> float: ...


PULL_BLOCK_MS = 5000
"""A job's arrival ends the read at once; the block only sets how often an idle worker asks again (within the
10 s deadline of a Redis call)."""
CHECK_FIRST_AFTER_MS = 1000
"""A job that waited in the queue longer than this is checked for a cancel before it starts. A younger one
starts at once, off the time-to-first-token path, and is aborted if the check finds it cancelled: a cancel
sent while it waits also reaches the worker on the cancel channel."""
CHECK_WAIT_S = bus.START_NOTICE_S - 2.0
"""How long an older job waits for that check (it rides the publisher's next write, which waits out a Redis
outage): past it the job starts, and the check's answer, when it comes, still aborts it or routes its events. Its
Started event must reach the edge within bus.START_NOTICE_S of the decision to start: 2 s are left for that."""

Entries = list[tuple[bytes, dict[bytes, bytes]]]
"""Entries of a request stream: their ids and fields."""
MOVED_FIELD = b"m"
"""Marks an entry moved back to the model's stream from a worker's own after that worker, having read it, stopped
beating (shared.tenancy.fairshare_lua.RESCUE): it is taken over as a claim is."""


@dataclass(frozen=True)
class Marks:
    """What a job's marks in Redis say: a cancel, or an edge that resumed it elsewhere (read when a fresh job
    starts, and for the running ones after the subscription that brings cancels and routes was down)."""

    cancelled: bool
    reply_to: str | None

    @staticmethod
    def commands(job_ids: list[str]) -> list[tuple[rawpipe.Arg, ...]]:
        """The reads of the jobs' marks, two per job; `read` takes their replies."""
        return [command for job_id in job_ids
                for command in (("EXISTS", keys.cancelled(job_id)), ("GET", keys.job_reply_to(job_id)))]

    @classmethod
    def read(cls, replies: list[Any]) -> list[Marks]:
        return [cls(bool(cancelled), reply_to.decode() if reply_to else None)
                for cancelled, reply_to in zip(replies[::2], replies[1::2], strict=True)]


def _answer(marks: asyncio.Future[list[Marks]], index: int) -> Marks | None:
    """What a batch's read of marks found for one of its jobs; None while it has no answer (not yet, or failed)."""
    if not marks.done() or marks.cancelled() or marks.exception() is not None:
        return None
    return marks.result()[index]


class Intake:
    """Brings jobs to the runner: pulled, decoded, checked and started, or taken over."""

    def __init__(self, settings: IntakeSettings, engine: Engine, worker_id: str, jobs: JobTable, runner: JobRunner,
                 publisher: EventPublisher, scheduler: SchedulerLink, ownership: Ownership,
                 redis: aioredis.Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id
        self.model = settings.model
        self.stream = keys.requests_stream(settings.model)
        self.jobs = jobs
        self.runner = runner
        self.publisher = publisher
        self.scheduler = scheduler
        self.ownership = ownership
        self.redis = redis
        self.pulls = rawpipe.Pipelines(redis)
        """The pull's blocking read, raw on a connection it holds for good: it is on every job's way to the
        engine, and redis-py converts each reply and checks a connection out of its pool in Python."""

    async def ensure_group(self) -> None:
        """The workers' group on the model's stream and on this worker's own (made if missing)."""
        try:
            await self.redis.xgroup_create(self.stream, keys.WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        await self.ownership.register()

    async def pull(self) -> None:
        """Reads jobs into free slots. The scheduler's dispatch fills the request stream at the first read (this
        worker's slots join the offer); after that an edge's enqueue, the settle written with each finished job's
        ack and the heartbeat's offer renewal dispatch, so an idle read costs no script call. One read takes the
        jobs placed on this worker's own stream and those on the model's."""
        await self.scheduler.dispatch()
        while True:
            free = self.jobs.free_slots()
            if free <= 0:
                await self.jobs.until_a_job_ends()
                continue
            try:
                pipe = self.pulls.pipeline()
                pipe.execute_command("XREADGROUP", "GROUP", keys.WORKER_GROUP, self.worker_id, "COUNT", free,
                                     "BLOCK", PULL_BLOCK_MS, "STREAMS", self.ownership.own, self.stream, ">", ">")
                reply = (await pipe.execute())[0]
            except ResponseError as exc:
                if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                # Redis lost its data (a restart without persistence), or another worker's rescue took this one for
                # stopped (its offer lapsed while its loop was held up) and removed its own stream under the read
                await self.ensure_group()
                continue
            except (RedisError, OSError) as exc:
                log.warning("reading jobs failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            own, shared = self._split(reply)
            if (excess := len(own) + len(shared) - free) > 0:  # COUNT is per stream: more than the free slots came
                shared, extra = shared[:len(shared) - excess], shared[len(shared) - excess:]
                await self._give_back(extra)
            self._accept(own, self.ownership.own)
            self._accept(shared, "")
            await asyncio.sleep(0)  # the jobs just accepted reach the engine before the next pull is sent

    def _split(self, reply: Any) -> tuple[Entries, Entries]:
        """A read's entries: those of this worker's own stream, and those of the model's."""
        found: dict[bool, Entries] = {True: [], False: []}
        for stream, entries in rawpipe.streams_entries(reply):
            shared = stream in (self.stream, self.stream.encode())
            found[shared] += [(entry_id, rawpipe.field_map(fields)) for entry_id, fields in entries]
        return found[False], found[True]

    async def _give_back(self, entries: Entries) -> None:
        """Entries of the model's stream read beyond the free slots go back on the queue for the next free worker
        (a failed give-back keeps them here: they run when a slot frees, or are claimed if this worker dies)."""
        for entry_id, fields in entries:
            try:
                job = bus.decode_job(fields[bus.JOB_FIELD])
            except (KeyError, ValueError):
                job = None
            try:
                await self.ownership.give_back(entry_id, fields, job)
            except (RedisError, OSError) as exc:
                log.warning("giving back a job read beyond the free slots failed (%s); it waits here", exc)
                self._accept([(entry_id, fields)], "")

    def claimed(self, entries: Entries, stream: str = "") -> None:
        """Takes over the jobs of the entries claimed from a worker that stopped beating (or moved back to the
        model's stream from its own, then read from `stream`: "" the model's, or this worker's own, where dispatch
        may have placed them again; each is acknowledged on the stream it was read from)."""
        for run in self._decode(entries, stream):
            if run.job.id in self.jobs:  # ours, grown idle while Redis was away: the claim only refreshed it
                continue
            metrics.RECLAIMS.labels(self.model).inc()
            log.info("claimed job %s from a worker that stopped beating", run.job.id)
            self._start(run, self._take_over(run, reclaimed=True))

    def _decode(self, entries: Entries, stream: str) -> list[Run]:
        """A run for each well-formed entry of a stream ("": the model's); a malformed one is dropped."""
        jobs: list[Run] = []
        for entry_id, fields in entries:
            try:
                jobs.append(Run(bus.decode_job(fields[bus.JOB_FIELD]), entry_id, fairshare.Ticket.from_fields(fields),
                                stream=stream))
            except (KeyError, ValueError) as exc:
                log.error("dropping malformed job entry %s: %s", entry_id, type(exc).__name__)
                self.publisher.ack_after(stream or self.stream, keys.WORKER_GROUP, entry_id)
        return jobs

    def _accept(self, entries: Entries, stream: str) -> None:
        """Starts a batch of jobs of a stream; one lookup, in the publisher's next write, tells which were
        cancelled or resumed while they waited."""
        if moved := [(entry_id, fields) for entry_id, fields in entries if MOVED_FIELD in fields]:
            self.claimed(moved, stream)  # read by a worker that stopped beating, then moved back to the model's stream
            entries = [(entry_id, fields) for entry_id, fields in entries if MOVED_FIELD not in fields]
        runs = self._decode(entries, stream)
        fresh = [run for run in runs if not run.job.handovers]
        for run in runs:
            if run.job.handovers:
                self._start(run, self._take_over(run, reclaimed=False))
        if not fresh:
            return
        # registered before the read, so that a cancel published meanwhile finds them; their tasks, made first,
        # reach the engine (and publish their first events, which the read's write carries) before it is sent
        marks: asyncio.Future[list[Marks]] = asyncio.get_running_loop().create_future()
        for i, run in enumerate(fresh):
            self._start(run, self._run_fresh(run, marks, i))
        self._read_marks([run.job.id for run in fresh], marks)

    def _start(self, run: Run, work: Coroutine[Any, Any, None]) -> None:
        self.jobs.add(run, asyncio.create_task(self.runner.own(run, work), name=f"job-{run.job.id}"))

    def _read_marks(self, job_ids: list[str], marks: asyncio.Future[list[Marks]]) -> None:
        """Asks whether each job was cancelled, or resumed on another edge, while it waited: in the publisher's
        next write (with the first events of the jobs), not in a round trip of its own."""
        def found(replies: list[Any]) -> None:
            if marks.done():
                return
            if failed := next((reply for reply in replies if isinstance(reply, Exception)), None):
                marks.set_exception(failed)  # the runs waiting on it see the failure
                return
            marks.set_result(Marks.read(replies))

        self.publisher.then(Marks.commands(job_ids), found)

    def _obey_marks(self, run: Run, index: int, marks: asyncio.Future[list[Marks]]) -> None:
        if (found := _answer(marks, index)) is None:
            return
        if found.reply_to:
            run.job.reply_to = found.reply_to
        if found.cancelled:
            self.runner.in_background(self.runner.abort(run.job.id))

    async def _run_fresh(self, run: Run, marks: asyncio.Future[list[Marks]], index: int) -> None:
        job = run.job
        waited_ms = bus.now_ms() - job.created_ms
        cancelled = run.aborted
        if not cancelled and waited_ms > CHECK_FIRST_AFTER_MS:
            await asyncio.wait([marks], timeout=CHECK_WAIT_S)
            cancelled = (found := _answer(marks, index)) is not None and found.cancelled
        if cancelled:
            metrics.JOBS.labels(self.model, "cancelled").inc()  # its client left while it was queued
            if job.background:  # its log ends, for whoever renders it
                self.runner.end_with(run, StreamAbandoned("The response was cancelled before it started."))
            return
        tenant = self.runner.tenants.label(run.job.tenant)
        metrics.QUEUE_WAIT.labels(self.model, tenant).observe(max(0, waited_ms) / 1000)
        if job.created_ms and waited_ms > self.settings.queue_timeout_s * 1000:
            await asyncio.wait([marks], timeout=CHECK_WAIT_S)  # it may have been resumed on another edge meanwhile
            self._obey_marks(run, index, marks)
            self.runner.end_with(run, QueueTimeout(
                f"The request waited {waited_ms / 1000:.0f} s for a worker, longer than the queue timeout "
                f"({self.settings.queue_timeout_s:g} s); it was not started."))
            metrics.JOBS.labels(self.model, "queue_timeout").inc()
            return
        marks.add_done_callback(lambda done: self._obey_marks(run, index, done))
        await self.runner.serve(run, resumed=False)

    async def _take_over(self, run: Run, reclaimed: bool) -> None:
        """Runs a job another worker began: after what its log holds, under a new epoch."""
        job = run.job
        keep_s = (job.deadline_ms - bus.now_ms() + job.log_kept_ms(int(self.settings.replay_ttl_s * 1000))) / 1000
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
        await self.ownership.dead_letter(run, reason)
        run.give_up()
        self.runner.end_with(run, WorkerLost(f"The job was given up: {reason}."))
        metrics.DEAD_LETTERS.labels(self.model).inc()
        metrics.JOBS.labels(self.model, "dead_letter").inc()
        log.warning("job %s went to the dead-letter stream: %s", run.job.id, reason)
