"""A job's life on a worker, from its slot to its settlement: the engine's outputs published as its events, its
end (an outcome and, whatever happened, a last event), its acknowledgement after its events, and what it cost
settled with its tenant."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from services.worker.jobtable import JobTable, Phase, Run
from services.worker.parsing.formats import tool_format
from services.worker.parsing.output import for_job
from services.worker.parsing.reasoning import reasoning_format
from services.worker.prefix_summary import PrefixSummary
from services.worker.publisher import EventPublisher
from shared.protocol import bus, keys
from shared.protocol.errors import EngineError, RequestTimeout, StreamAbandoned, TokenbusError, kind_of
from shared.runtime import logs, metrics
from shared.tenancy.limits import Settlements
from shared.tenancy.storage import LogCharges

log = logging.getLogger(__name__)


class RunnerSettings(Protocol):
    """The settings the runner reads (Settings has them)."""

    @property
    def metrics_max_tenants(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def reasoning_parser(self) -> str: ...
    @property
    def replay_ttl_s(self) -> float: ...
    @property
    def tool_parser(self) -> str: ...


T = TypeVar("T")

UNREPLAYABLE_LOG_KEEP_S = 60.0
"""How long the log of a job nobody can resume is kept after its end: time for its edge to read what it missed (a
gap in its subscription, a Redis failover), not --replay-ttl-s of answers nobody may read again."""


class Engine(Protocol):
    """What the worker needs of an engine (vLLM, or a simulator for benchmarks and fault tests)."""

    cache_tokens: int
    """Tokens its prefix (KV) cache holds; 0: unknown."""

    max_model_len: int
    dimensions: int
    max_loras: int
    """LoRA adapters it runs at once; 0: it serves none."""

    def static_adapters(self) -> list[str]:
        """The adapters it was started with (--lora)."""
        ...

    def held_adapters(self) -> list[str]:
        """The adapters it holds loaded now."""
        ...

    async def run_into(self, job: bus.Job, priority: int, take: Callable[[bus.Output], None]) -> None:
        """Hands the job's outputs to `take` as they come (it never waits; what it raises ends the run and is
        raised here, the job's engine requests aborted); among requests waiting in the engine, a lower
        `priority` goes first."""
        ...

    async def abort(self, job_id: str) -> None: ...

    def dead(self) -> bool:
        """Whether it can serve no more (vLLM's engine core died): its jobs are for other workers."""
        ...

    def decode(self, job: bus.Job, token_ids: list[int]) -> str:
        """The text of tokens the job generated (to bring its parsers back to where a former owner was)."""
        ...


class _Stopped(Exception):
    """A job's output came after it was stopped (its client went, or another worker took it over)."""


def most_log_entries(job: bus.Job, context_tokens: int) -> int:
    """The entries a job's log can take: one per event at most (a Tokens event has a token, but for each
    choice's last), its Started, its prompts' events, its Final or Error; `context_tokens` bounds its tokens."""
    tokens = min(job.params.max_tokens or context_tokens, context_tokens)
    return job.sequences() * (max(0, tokens) + 2) + 8


def error_event(job_id: str, error: TokenbusError) -> bus.Error:
    return bus.Error(job=job_id, kind=kind_of(error), message=error.message, param=error.param,
                     code=error.code)



class JobRunner:
    """Runs the jobs of one worker, each from its slot to its settlement."""

    def __init__(self, settings: RunnerSettings, engine: Engine, worker_id: str, jobs: JobTable,
                 publisher: EventPublisher, redis: aioredis.Redis, prefixes: PrefixSummary | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id
        self.model = settings.model
        self.stream = keys.requests_stream(settings.model)
        self.jobs = jobs
        self.publisher = publisher
        self.tool_format = tool_format(settings.tool_parser)
        self.reasoning = reasoning_format(settings.reasoning_parser)
        self.generated_tokens = metrics.GENERATED_TOKENS.labels(self.model)
        """Counted per engine output: the labelled child is looked up once, not per token."""
        self.settlements = Settlements(redis)
        self.log_charges = LogCharges(redis)
        self.tenants = metrics.TenantLabels(settings.metrics_max_tenants)
        self.background: set[asyncio.Task[Any]] = set()
        """Cancel checks, the aborts they lead to and settles on their own, kept referenced until they end."""
        self.prefixes = prefixes
        """What the engine holds, as placement sees it: each job's prompt is in it once the job starts."""
        self.on_engine_died: Callable[[], None] = lambda: None
        """Called as a job finds the engine dead (the worker stops, and hands its jobs over)."""
        self.handing_over = asyncio.Event()
        """Set once the worker let go of its running jobs to hand them over (a dead engine's jobs wait for it)."""

    async def own(self, run: Run, work: Coroutine[Any, Any, None]) -> None:
        """Runs a job's work; whatever happens, frees its slot and acknowledges its entry after its events."""
        logs.REQUEST_ID.set(run.job.request_id or run.job.id)  # this task's log records name the request
        if run.job.replayable:
            self.publisher.size_log(run.job.id)
        if run.job.background:  # its log is its only record until an edge stores its answer: none of it is trimmed
            self.publisher.keep_log(run.job.id, most_log_entries(run.job, self.engine.max_model_len))
        try:
            async with self.jobs.slots.held(run.job.sequences()):  # read jobs that do not fit yet wait their turn here
                await work
        finally:
            self.jobs.remove(run)
            if run.acknowledges:  # the run that ends the job settles its fair-share charge with the ack
                self.publisher.ack_after(run.stream or self.stream, keys.WORKER_GROUP, run.entry_id,
                                         run.settlement())
            if run.publishes:  # this owner ended the job: settle what it cost its key
                self._settle_cost(run)
            if run.job.replayable:
                self.publisher.then([], lambda _replies: self._charge_log(run.job))
            if run.job.background:  # after its last write
                self.publisher.then([], lambda _replies: self.publisher.release_log(run.job.id))

    def _publish_prefixes(self, summary: PrefixSummary) -> None:
        """What the engine now holds, in the publisher's next write: dispatch places the next job by it."""
        commands, changes = summary.commands()
        self.publisher.then(commands, lambda replies: summary.written(changes, replies))

    async def serve(self, run: Run, resumed: bool) -> None:
        """Runs the job in the engine and ends it: one outcome counted and, while it is this worker's, a last event."""
        outcome = "finished"
        try:  # one stopped, or taken by another worker, while it waited for its slots never reaches the engine
            outcome = ("aborted" if run.aborted else "handed_over" if not run.publishes
                       else await self._generate(run, resumed))
        except TokenbusError as exc:
            outcome = "rejected"
            self.end_with(run, exc)
        except Exception:
            if self.engine.dead():  # not the job's fault: it goes on elsewhere, from what its client has
                await self._hand_over_from_dead_engine(run)
                return
            outcome = "failed"
            log.exception("job %s failed in the engine", run.job.id)
            self.end_with(run, EngineError("The engine failed."))
        finally:
            if not run.publishes:
                outcome = "handed_over"
            elif run.aborted:  # its log still ends, for a client that tries to resume it
                abandoned = run.phase is Phase.ABANDONED
                why = "Nobody resumed the stream in time" if abandoned else "The stream was cancelled"
                self.end_with(run, StreamAbandoned(f"{why}; it was stopped."))
            metrics.JOBS.labels(self.model, outcome).inc()

    async def _hand_over_from_dead_engine(self, run: Run) -> None:
        """Holds the job (its entry unacknowledged, nothing more published) until the worker, which stops, has
        let go of it to hand it over; past its deadline, or if the worker never does, its entry is left pending
        for a live worker to claim."""
        log.error("job %s stopped: the engine died", run.job.id)
        self.on_engine_died()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, (run.job.deadline_ms - bus.now_ms()) / 1000)):
                await self.handing_over.wait()
        run.let_go()

    def emit(self, run: Run, event: bus.Event, log_ttl_ms: int = 0) -> None:
        """Publishes one event of the job at its next position, unless the job is no longer this worker's."""
        if not run.publishes:
            return
        event.seq, event.epoch = run.next_seq, run.epoch
        run.next_seq += 1
        if isinstance(event, bus.Tokens):
            run.generated += len(event.token_ids)
        elif isinstance(event, bus.Final):
            run.usage = (event.prompt_tokens, event.completion_tokens)
        self.publisher.publish(run.job.reply_to, event, log_ttl_ms)

    def log_kept_ms(self, job: bus.Job) -> int:
        """How long the job's log is kept after its end: a background response's retention, a resumable stream's
        --replay-ttl-s; the log of any other (its answer's text, which nobody can replay) only as long as an edge
        may take to read what it missed (UNREPLAYABLE_LOG_KEEP_S)."""
        kept_ms = job.log_kept_ms(int(self.settings.replay_ttl_s * 1000))
        return kept_ms if job.replayable else min(kept_ms, int(UNREPLAYABLE_LOG_KEEP_S * 1000))

    def end_with(self, run: Run, error: TokenbusError) -> None:
        self.emit(run, error_event(run.job.id, error), self.log_kept_ms(run.job))

    async def _generate(self, run: Run, resumed: bool) -> str:
        job = run.job
        remaining_s = (job.deadline_ms - bus.now_ms()) / 1000
        if remaining_s <= 0:
            raise RequestTimeout("The request expired while it waited in the queue.")
        replay_ms = self.log_kept_ms(job)
        self.emit(run, bus.Started(job=job.id, worker=self.worker_id, resumed=resumed),
                  int(remaining_s * 1000) + replay_ms)
        carried = job.continuation.carried() if job.continuation else 0
        if run.output is None:
            run.output = for_job(job, self.tool_format, self.reasoning)
        summary = self.prefixes
        if summary is not None and summary.started(job):
            self._publish_prefixes(summary)
        running = metrics.RUNNING_JOBS.labels(self.model)
        running.inc()
        priority = self.jobs.begin(run)
        try:
            async with asyncio.timeout(remaining_s):
                await self.engine.run_into(job, priority, self._taker(run, carried, replay_ms))
        except _Stopped:
            await self.engine.abort(job.id)
        except TimeoutError:
            await self.engine.abort(job.id)
            raise RequestTimeout("The request did not finish before its deadline.") from None
        finally:
            running.dec()
            if summary is not None and summary.ended(job.id, run.usage[0] if run.usage else 0):
                self._publish_prefixes(summary)
        return "aborted" if run.aborted else "finished"

    def _taker(self, run: Run, carried: int, replay_ms: int) -> Callable[[bus.Output], None]:
        """Where the engine hands the job's outputs, as it makes them: through its parsers to its client (an output
        after it was stopped ends its run: the cancel may have come before the engine knew the request)."""
        summary = self.prefixes
        prefilled = summary is None

        def take(event: bus.Output) -> None:
            nonlocal prefilled
            if run.aborted or not run.publishes:
                raise _Stopped
            if not prefilled:  # the engine's first output: the prompt is in its cache
                prefilled = True
                if summary is not None and summary.prefilled(run.job.id):
                    self._publish_prefixes(summary)
            self._pass_on(run, event, carried, replay_ms)

        return take

    def _pass_on(self, run: Run, event: bus.Output, carried: int, replay_ms: int) -> None:
        """One event of the engine, through the job's parsers, to its client."""
        if isinstance(event, bus.Final):
            event.completion_tokens += carried
        if isinstance(event, bus.Tokens):
            self.generated_tokens.inc(len(event.token_ids))
        for out in [event] if run.output is None else run.output.rewrite(event):
            self.emit(run, out, replay_ms if isinstance(out, bus.Final) else 0)

    def _settle_cost(self, run: Run) -> None:
        """Settles the job's reservation with what it used (a job that ended early counts its estimate), in the
        write that carries its last events."""
        job = run.job
        prompt, completion = run.used()
        command = self.settlements.command(job, prompt, completion)
        if command is not None:
            self.publisher.then([command], lambda replies: self._cost_settled(job, prompt, completion, replies[0]))

    def _charge_log(self, job: bus.Job) -> None:
        """Charges what this worker wrote to the job's log (written by now: this runs after the job's last write)
        to its tenant's storage, for as long as the log is kept after its end."""
        size = self.publisher.logged_bytes(job.id)
        if size:
            self.in_background(self.log_charges.charge(job, size, self.log_kept_ms(job)))

    def _cost_settled(self, job: bus.Job, prompt: int, completion: int, reply: Any, alone: bool = False) -> None:
        """Takes the settle's reply: counts the usage it recorded, or settles on its own (which loads the script)
        when Redis had lost it."""
        if isinstance(reply, NoScriptError) and not alone:
            self.in_background(self._settle_alone(job, prompt, completion))
        elif isinstance(reply, Exception):
            log.warning("could not settle job %s (%s): its reservation stays spent", job.id, type(reply).__name__)
        elif reply:
            metrics.TENANT_TOKENS.labels(self.model, self.tenants.label(job.tenant), "prompt").inc(prompt)
            metrics.TENANT_TOKENS.labels(self.model, self.tenants.label(job.tenant), "completion").inc(completion)

    async def _settle_alone(self, job: bus.Job, prompt: int, completion: int) -> None:
        try:
            reply: Any = await self.settlements.settle(job, prompt, completion)
        except (RedisError, OSError) as exc:
            reply = exc
        self._cost_settled(job, prompt, completion, reply, alone=True)

    async def abort(self, job_id: str, abandoned: bool = False) -> None:
        """Aborts a running job in the engine (its client went away, or `abandoned`: its edge did and no resume
        came); its generator then ends by itself."""
        if (run := self.jobs.abort(job_id, abandoned)) is None:
            return
        await self.engine.abort(job_id)
        metrics.ENGINE_ABORTS.labels(self.model).inc()
        with logs.about(run.job.request_id or job_id):
            log.info("aborted job %s in the engine: its client went away", job_id)

    def in_background(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task
