"""A worker's supervision round rides its heartbeat's write: what it reads there reaches the queue gauges an
autoscaler scales on, and the jobs of a worker that stopped beating (a worker on the simulated engine, in this
process, on a real Redis)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

from services.worker.sim import SimEngine
from services.worker.worker import Worker
from shared.protocol import bus, keys
from shared.runtime.settings import Settings
from tests.channel import listening

BEAT_S = 0.2
TOKENS = 4


@pytest.fixture
async def start_worker(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[Worker]]]:
    started: list[Worker] = []

    async def start(model: str, **overrides: Any) -> Worker:
        settings = Settings(redis_url=redis_url, model=model, engine="sim", heartbeat_interval_s=BEAT_S,
                            heartbeat_ttl_s=5 * BEAT_S, **overrides)
        worker = Worker(settings, SimEngine(settings))
        await worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.stop()


def _job(model: str, reply_to: str) -> bus.Job:
    return bus.Job(id=f"test-{uuid.uuid4().hex}", model=model, reply_to=reply_to,
                   deadline_ms=bus.now_ms() + 60_000, messages=[bus.Message(role="user", content="Hi")],
                   params=bus.SamplingParams(max_tokens=TOKENS, ignore_eos=True), created_ms=bus.now_ms())


def _gauge(name: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": model})


async def _until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_the_queue_gauges_count_the_jobs_waiting_behind_a_full_worker(
    redis_client: redis.Redis, start_worker: Callable[..., Awaitable[Worker]]
) -> None:
    model = f"rounds-{uuid.uuid4().hex[:8]}"
    await start_worker(model, max_num_seqs=1, sim_ttft_ms=30_000, worker_grace_s=0.5)
    for _ in range(4):
        redis_client.xadd(keys.requests_stream(model), {bus.JOB_FIELD: bus.encode_job(_job(model, "nobody"))})
    counted = await _until(lambda: _gauge("tokenbus_queued_jobs", model) == 3
                           and _gauge("tokenbus_stream_pending", model) == 1, 20 * BEAT_S)
    assert counted, (_gauge("tokenbus_queued_jobs", model), _gauge("tokenbus_stream_pending", model))
    assert _gauge("tokenbus_stream_length", model) == 4


async def test_the_queue_gauges_count_the_jobs_on_a_workers_own_stream(
    redis_client: redis.Redis, start_worker: Callable[..., Awaitable[Worker]]
) -> None:
    """Cache-aware dispatch puts most jobs onto a worker's own stream: the gauges (and the autoscaler reading them)
    count them as they count the model's stream's."""
    model = f"rounds-{uuid.uuid4().hex[:8]}"
    worker = await start_worker(model, max_num_seqs=1, sim_ttft_ms=30_000, worker_grace_s=0.5)
    redis_client.xadd(keys.requests_stream(model), {bus.JOB_FIELD: bus.encode_job(_job(model, "nobody"))})
    for _ in range(2):
        redis_client.xadd(keys.worker_requests(model, worker.id),
                          {bus.JOB_FIELD: bus.encode_job(_job(model, "nobody"))})
    counted = await _until(lambda: _gauge("tokenbus_stream_length", model) == 3
                           and _gauge("tokenbus_stream_pending", model) == 1, 20 * BEAT_S)
    assert counted, (_gauge("tokenbus_stream_length", model), _gauge("tokenbus_stream_pending", model))
    assert _gauge("tokenbus_queued_jobs", model) == 2 and _gauge("tokenbus_stream_lag", model) == 2


async def test_the_jobs_of_a_worker_that_stopped_beating_are_claimed_and_finished(
    redis_client: redis.Redis, start_worker: Callable[..., Awaitable[Worker]]
) -> None:
    """A job read by a consumer that never beats (a worker that died the moment it read it) is claimed by a live
    worker once idle past the heartbeat's TTL, and its client gets every token."""
    model = f"rounds-{uuid.uuid4().hex[:8]}"
    stream = keys.requests_stream(model)
    redis_client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    with listening(redis_client, reply_to) as listener:
        redis_client.xadd(stream, {bus.JOB_FIELD: bus.encode_job(_job(model, reply_to))})
        assert redis_client.xreadgroup(keys.WORKER_GROUP, "a-dead-worker", {stream: ">"}, count=1)
        await start_worker(model, sim_ttft_ms=10, sim_itl_ms=5)
        events = await asyncio.to_thread(listener.events, 30 * BEAT_S)
    kinds = [type(e) for _t, e in events]
    assert kinds == [bus.Started] + [bus.Tokens] * TOKENS + [bus.Final], kinds
    assert not redis_client.xpending(stream, keys.WORKER_GROUP)["pending"]


async def test_a_wide_job_waits_for_its_slots_and_nothing_read_after_it_goes_first(
    redis_client: redis.Redis, start_worker: Callable[..., Awaitable[Worker]]
) -> None:
    """A worker of 4 slots running a job reads a job of 4 choices and a narrow one after it: the wide one starts
    once the first has ended (never more than 4 sequences in the engine), and the narrow one after the wide one
    began, although a slot was free for it all along."""
    model = f"rounds-{uuid.uuid4().hex[:8]}"
    worker = await start_worker(model, max_num_seqs=4, sim_ttft_ms=10, sim_itl_ms=20, scheduler="fifo")
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    first, wide, last = _job(model, reply_to), _job(model, reply_to), _job(model, reply_to)
    first.params = bus.SamplingParams(max_tokens=10, ignore_eos=True)
    wide.kind, wide.messages, wide.prompts = "completion", [], ["count"]
    wide.params = bus.SamplingParams(max_tokens=TOKENS, n=4, ignore_eos=True)
    busiest = 0

    def engine_load() -> bool:
        nonlocal busiest
        busiest = max(busiest, len(worker.engine.running))
        return False

    with listening(redis_client, reply_to) as listener:
        for job in (first, wide, last):
            redis_client.xadd(keys.requests_stream(model), {bus.JOB_FIELD: bus.encode_job(job)})
        watching = asyncio.create_task(_until(engine_load, 3.0))
        events = await asyncio.to_thread(_all_events, listener, 3, 10.0)
        watching.cancel()
    started = [e.job for _t, e in events if isinstance(e, bus.Started)]
    ended = {e.job: at for at, e in events if isinstance(e, bus.Final)}
    assert started == [first.id, wide.id, last.id]
    began = {e.job: at for at, e in events if isinstance(e, bus.Started)}
    assert began[wide.id] >= ended[first.id] and began[last.id] >= began[wide.id]
    assert len(ended) == 3 and 0 < busiest <= 4, (ended, busiest)


def _all_events(listener: Any, jobs: int, wait_s: float) -> list[tuple[float, bus.Event]]:
    """Events of `jobs` jobs on one channel, until each has its Final (or `wait_s`)."""
    deadline = time.monotonic() + wait_s
    events: list[tuple[float, bus.Event]] = []
    while time.monotonic() < deadline and sum(isinstance(e, bus.Final) for _t, e in events) < jobs:
        events += listener.events(max(0.1, deadline - time.monotonic()))
    return events


async def test_a_job_read_beyond_the_free_slots_goes_back_for_another_worker(
    redis_client: redis.Redis, start_worker: Callable[..., Awaitable[Worker]]
) -> None:
    """One read takes up to the free slots from each of the worker's two streams: a one-slot worker that finds a
    job on its own stream and one on the model's when its slot frees keeps the first and puts the second back,
    unread, where a second worker takes it at once (it does not wait behind the first)."""
    model = f"rounds-{uuid.uuid4().hex[:8]}"
    first = await start_worker(model, max_num_seqs=1, sim_ttft_ms=1_000, worker_grace_s=0.5)
    shared = keys.requests_stream(model)
    redis_client.xadd(shared, {bus.JOB_FIELD: bus.encode_job(_job(model, "nobody"))})
    assert await _until(lambda: len(first.jobs) == 1, 20 * BEAT_S)
    redis_client.xadd(keys.worker_requests(model, first.id), {bus.JOB_FIELD: bus.encode_job(_job(model, "nobody"))})
    redis_client.xadd(shared, {bus.JOB_FIELD: bus.encode_job(_job(model, "nobody"))})

    def given_back() -> bool:
        group = next(g for g in redis_client.xinfo_groups(shared) if g["name"] == keys.WORKER_GROUP.encode())
        return group["pending"] == 0 and group["lag"] == 1 and len(first.jobs) == 1

    assert await _until(given_back, 30 * BEAT_S), redis_client.xinfo_groups(shared)
    second = await start_worker(model, max_num_seqs=1, sim_ttft_ms=1_000, worker_grace_s=0.5)
    assert await _until(lambda: len(second.jobs) == 1, 20 * BEAT_S)


async def test_a_worker_that_has_said_it_is_gone_does_not_beat_again(
    redis_client: redis.Redis, start_worker: Callable[..., Awaitable[Worker]]
) -> None:
    """A stopping worker removes its heartbeat before its loops are cancelled (edges stop counting it at once);
    a beat after that, or one in flight then, would make it look alive for another TTL, and edges would queue
    work for it."""
    model = f"rounds-{uuid.uuid4().hex[:8]}"
    worker = await start_worker(model)
    heartbeat = keys.worker_heartbeat(model, worker.id)
    assert await _until(lambda: redis_client.exists(heartbeat) == 1, 20 * BEAT_S)
    await worker.upkeep.forget()
    assert redis_client.exists(heartbeat) == 0
    await asyncio.sleep(4 * BEAT_S)  # four beats' time, the loops not yet cancelled
    assert redis_client.exists(heartbeat) == 0, "the worker beat again after it said it was gone"
