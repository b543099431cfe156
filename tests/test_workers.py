"""Several workers of one model share its queue by themselves, and a dead worker's heartbeat expires."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
import redis

from shared.protocol import keys
from tests.processes import GATHERING_MODEL, MODEL, WorkerProcess, metric_value, running_worker

pytestmark = pytest.mark.engine


def _finished_jobs(metrics_url: str) -> float:
    return metric_value(httpx.get(metrics_url).text, "tokenbus_worker_jobs_total", {"outcome": "finished"})


def _heartbeats(redis_client: redis.Redis, model: str = MODEL) -> set[bytes]:
    return set(redis_client.scan_iter(match=keys.worker_heartbeat(model, "*")))


async def test_a_second_worker_takes_its_share_and_its_heartbeat_dies_with_it(
    client: openai.AsyncOpenAI, gathering_worker: WorkerProcess, gathering_twin: WorkerProcess,
    redis_client: redis.Redis,
) -> None:
    """The session's two real workers of GATHERING_MODEL share its queue (the twin has two slots: it may take at
    most two jobs at a time, the rest stay for the first); the twin killed, its heartbeat expires within its TTL
    (2 s) and the model stays served by the other."""
    beats = _heartbeats(redis_client, GATHERING_MODEL)
    assert len(beats) == 2, beats
    before = (_finished_jobs(gathering_worker.metrics_url), _finished_jobs(gathering_twin.metrics_url))
    prompt = [{"role": "user", "content": "Tell me about the ocean."}]
    await asyncio.gather(*(
        client.chat.completions.create(model=GATHERING_MODEL, messages=prompt, max_tokens=24, timeout=120,
                                       extra_body={"ignore_eos": True})
        for _ in range(12)
    ))
    after = (_finished_jobs(gathering_worker.metrics_url), _finished_jobs(gathering_twin.metrics_url))
    shares = [b - a for a, b in zip(before, after, strict=True)]
    assert sum(shares) == 12
    assert all(share > 0 for share in shares), shares

    os.killpg(gathering_twin.process.pid, signal.SIGKILL)  # as when its container dies: the engine goes too
    gathering_twin.process.wait(timeout=10)
    killed = time.monotonic()
    survivor = {beat for beat in beats if f"-{gathering_twin.process.pid}-".encode() not in beat}
    assert len(survivor) == 1, beats
    while _heartbeats(redis_client, GATHERING_MODEL) != survivor:
        assert time.monotonic() - killed < 5, "the dead worker's heartbeat did not expire"
        await asyncio.sleep(0.2)
    assert GATHERING_MODEL in [m.id async for m in client.models.list()]


async def test_an_edge_finds_a_new_model_at_once_and_forgets_it_when_its_worker_dies(
    client: openai.AsyncOpenAI, redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A fault test: the simulated engine stands in for a worker that is killed; what is tested is how the
    edge learns which models have live workers (a registry of heartbeats, no keyspace scans)."""
    model = "fault-test-model"
    log = tmp_path_factory.mktemp("sim-worker") / "worker.log"
    with running_worker(redis_url, redis_client, log, model, engine="sim", heartbeat_ttl_s=2,
                        heartbeat_interval_s=0.5) as sim:
        # the edge started long before this worker: its first request must not wait for a refresh
        reply = await client.completions.create(model=model, prompt="count", max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert model in [m.id async for m in client.models.list()]
        assert any(name.startswith(f"tokenbus:worker:{model}:".encode())
                   for name in redis_client.zrange(keys.WORKERS, 0, -1))
        os.killpg(sim.process.pid, signal.SIGKILL)  # no goodbye: only its heartbeat's expiry tells
        sim.process.wait(timeout=10)
        killed = time.monotonic()
        while model in [m.id async for m in client.models.list()]:
            assert time.monotonic() - killed < 2 + 3, "the dead worker's model is still listed"
            await asyncio.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model=model, prompt="count", max_tokens=3)
