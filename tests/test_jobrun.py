"""A job's life on a worker without Redis or a real engine: the events it publishes, their positions, its outcome
on each path, and what its end writes (acknowledgement, settlement) by whose it is."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from services.worker.jobrun import JobRunner
from services.worker.jobtable import JobTable, Run
from services.worker.publisher import EventPublisher
from services.worker.streams import take_each
from shared.protocol import bus
from shared.runtime.settings import Settings


class _Publisher:
    """Records what the runner hands the publisher."""

    def __init__(self) -> None:
        self.events: list[bus.Event] = []
        self.acks: list[bytes] = []
        self.flowing = asyncio.Event()
        """Set once the job's Started and two tokens are out."""

    def publish(self, reply_to: str, event: bus.Event, log_ttl_ms: int = 0) -> None:
        self.events.append(event)
        if len(self.events) >= 3:
            self.flowing.set()

    def ack_after(self, stream: str, group: str, entry_id: bytes, settlement: Any = None) -> None:
        self.acks.append(entry_id)

    def then(self, commands: list[Any], on_replies: Callable[[list[Any]], None]) -> None:
        pass

    def size_log(self, job_id: str) -> None:
        pass


class _Engine:
    """Two tokens and a final, or a failure, or outputs until it is aborted."""

    max_model_len, dimensions = 128, 0

    def __init__(self, fail: bool = False, endless: bool = False) -> None:
        self.fail, self.endless, self.aborted = fail, endless, asyncio.Event()
        self.ran: list[str] = []

    async def run_into(self, job: bus.Job, priority: int, take: Callable[[bus.Output], None]) -> None:
        await take_each(self.run(job), take)

    async def run(self, job: bus.Job) -> AsyncIterator[bus.Output]:
        self.ran.append(job.id)
        if self.fail:
            raise RuntimeError("the engine broke")
        for i in range(10_000 if self.endless else 2):
            yield bus.Tokens(job=job.id, text="x", token_ids=[i])
            await asyncio.sleep(0)
        yield bus.Final(job=job.id, prompt_tokens=3, completion_tokens=2)

    async def abort(self, job_id: str) -> None:
        self.aborted.set()

    def dead(self) -> bool:
        return False

    def decode(self, job: bus.Job, token_ids: list[int]) -> str:
        return ""


def _runner(engine: _Engine) -> tuple[JobRunner, _Publisher, Run, str]:
    model = f"jobrun-{uuid.uuid4().hex[:8]}"
    publisher = _Publisher()
    runner = JobRunner(Settings(model=model, engine="sim"), engine, "w1", JobTable(4),
                       cast(EventPublisher, publisher), aioredis.Redis())  # never connected: nothing here reaches it
    job = bus.Job(id=f"test-{uuid.uuid4().hex}", model=model, reply_to="edge", deadline_ms=bus.now_ms() + 60_000,
                  messages=[bus.Message(role="user", content="Hi")])
    return runner, publisher, Run(job, b"1-0"), model


def _jobs(model: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("tokenbus_worker_jobs_total", {"model": model, "outcome": outcome}) or 0.0


def _start(runner: JobRunner, run: Run) -> asyncio.Task[None]:
    task = asyncio.create_task(runner.own(run, runner.serve(run, resumed=False)))
    runner.jobs.add(run, task)
    return task


async def _own(runner: JobRunner, run: Run) -> None:
    await _start(runner, run)


async def test_a_finished_job_publishes_in_order_then_is_acknowledged_and_forgotten() -> None:
    runner, publisher, run, model = _runner(_Engine())
    await _own(runner, run)
    assert [type(e) for e in publisher.events] == [bus.Started, bus.Tokens, bus.Tokens, bus.Final]
    assert [e.seq for e in publisher.events] == [0, 1, 2, 3] and run.used() == (3, 2)
    assert publisher.acks == [b"1-0"] and run.job.id not in runner.jobs and _jobs(model, "finished") == 1


async def test_a_failing_engine_ends_the_job_with_an_error() -> None:
    runner, publisher, run, model = _runner(_Engine(fail=True))
    await _own(runner, run)
    last = publisher.events[-1]
    assert isinstance(last, bus.Error) and last.kind == "EngineError", last
    assert _jobs(model, "failed") == 1 and publisher.acks == [b"1-0"]


@pytest.mark.parametrize("abandoned", [False, True])
async def test_an_aborted_job_stops_and_its_log_ends_with_why(abandoned: bool) -> None:
    engine = _Engine(endless=True)
    runner, publisher, run, model = _runner(engine)
    task = _start(runner, run)
    await publisher.flowing.wait()
    runner.jobs.abort(run.job.id, abandoned)
    await task
    last = publisher.events[-1]
    assert isinstance(last, bus.Error) and last.kind == "StreamAbandoned", last
    assert ("Nobody resumed" in last.message) is abandoned and engine.aborted.is_set()
    assert _jobs(model, "aborted") == 1


@contextlib.asynccontextmanager
async def _waiting_for_a_slot(runner: JobRunner, run: Run) -> AsyncIterator[None]:
    """Every slot taken, the job started and waiting for one in the block; after it, the slots free and the job
    ends."""
    taken, freed = asyncio.Event(), asyncio.Event()

    async def hold_every_slot() -> None:
        async with runner.jobs.slots.held(runner.jobs.slots.total):
            taken.set()
            await freed.wait()

    holder = asyncio.create_task(hold_every_slot())
    await taken.wait()
    task = _start(runner, run)
    await asyncio.sleep(0.01)  # waiting for its slot
    yield
    freed.set()
    await asyncio.gather(holder, task)


async def test_a_job_stopped_while_it_waits_for_its_slots_never_reaches_the_engine() -> None:
    """Its client left while the worker's slots were all taken: once they free, it ends with why, unrun (it ran: the
    engine's abort, made before the engine knew it, did nothing)."""
    engine = _Engine()
    runner, publisher, run, model = _runner(engine)
    async with _waiting_for_a_slot(runner, run):
        await runner.abort(run.job.id)
    last = publisher.events[-1]
    assert engine.ran == [] and isinstance(last, bus.Error) and last.kind == "StreamAbandoned", last
    assert _jobs(model, "aborted") == 1


async def test_a_job_taken_by_another_worker_while_it_waits_for_its_slots_never_reaches_the_engine() -> None:
    """Another worker took the job (this one stalled, or handed it over) while it waited for a slot here: it
    reached this engine anyway, for its whole prefill, before its first output stopped it."""
    engine = _Engine()
    runner, publisher, run, model = _runner(engine)
    async with _waiting_for_a_slot(runner, run):
        run.let_go()
    assert engine.ran == [] and publisher.events == [] and _jobs(model, "handed_over") == 1


async def test_a_job_let_go_publishes_nothing_more_and_is_not_acknowledged_here() -> None:
    engine = _Engine(endless=True)
    runner, publisher, run, model = _runner(engine)
    task = _start(runner, run)
    await publisher.flowing.wait()
    run.let_go()
    published = len(publisher.events)
    await task
    assert len(publisher.events) == published and publisher.acks == [] and _jobs(model, "handed_over") == 1
