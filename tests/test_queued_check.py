"""A job that waited in the queue is checked for a cancel before it starts; the check rides the worker's next
event write, which waits out a Redis outage. The job's wait for that answer has a deadline of its own: past it,
the job starts and its client gets the whole answer (a worker on the simulated engine, in this process, on a real
Redis; the check's answer is made never to come)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from services.worker import intake
from services.worker.sim import SimEngine
from services.worker.worker import Worker
from shared.protocol import bus, keys
from shared.runtime.settings import Settings
from tests.channel import listening

CHECK_WAIT_S = 0.5
TOKENS = 4


@pytest.fixture
async def worker(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Worker]:
    monkeypatch.setattr(intake, "CHECK_WAIT_S", CHECK_WAIT_S)
    settings = Settings(redis_url=redis_url, model=f"check-{uuid.uuid4().hex[:8]}", engine="sim",
                        sim_ttft_ms=10, sim_itl_ms=5, max_num_seqs=4)
    running = Worker(settings, SimEngine(settings))
    lost: list[Any] = []
    publisher_then = running.publisher.then

    def then(commands: list[Any], on_replies: Callable[[list[Any]], None]) -> None:
        if any(command[0] == "EXISTS" for command in commands):  # the queued job's check: its answer never comes
            lost.append(commands)
            return
        publisher_then(commands, on_replies)

    monkeypatch.setattr(running.publisher, "then", then)
    await running.start()
    yield running
    await running.stop()
    assert lost, "the worker did not ask whether the job was cancelled"


def _job(model: str, reply_to: str, queued_ms: int) -> bus.Job:
    return bus.Job(id=f"test-{uuid.uuid4().hex}", model=model, reply_to=reply_to,
                   deadline_ms=bus.now_ms() + 60_000, messages=[bus.Message(role="user", content="Hi")],
                   params=bus.SamplingParams(max_tokens=TOKENS, ignore_eos=True), created_ms=bus.now_ms() - queued_ms)


@pytest.mark.parametrize("queued_ms", [0, 3000])
async def test_a_job_whose_cancel_check_is_never_answered_starts_after_a_bounded_wait(
    redis_client: redis.Redis, worker: Worker, queued_ms: int
) -> None:
    """A young job starts at once without the answer; one that waited longer than a second gives it CHECK_WAIT_S,
    then starts; both stream every token."""
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    with listening(redis_client, reply_to) as listener:
        sent = time.monotonic()
        redis_client.xadd(keys.requests_stream(worker.model),
                          {bus.JOB_FIELD: bus.encode_job(_job(worker.model, reply_to, queued_ms))})
        events = await asyncio.to_thread(listener.events, CHECK_WAIT_S + 10)
    kinds = [type(e) for _t, e in events]
    assert kinds == [bus.Started] + [bus.Tokens] * TOKENS + [bus.Final], kinds
    started_after = events[0][0] - sent
    if queued_ms > intake.CHECK_FIRST_AFTER_MS:
        assert CHECK_WAIT_S <= started_after < CHECK_WAIT_S + 5
    else:
        assert started_after < CHECK_WAIT_S
