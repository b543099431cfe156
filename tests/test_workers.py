"""Several workers of one model share its queue by themselves, and a dead worker's heartbeat expires; an edge
learns of a new model at once and forgets it when its worker dies."""

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
from tests.processes import MODEL, metric_value, running_worker
from tests.stack import Stack


def _finished_jobs(metrics_url: str) -> float:
    return metric_value(httpx.get(metrics_url).text, "tokenbus_worker_jobs_total", {"outcome": "finished"})


def _heartbeats(redis_client: redis.Redis, model: str = MODEL) -> set[bytes]:
    return set(redis_client.scan_iter(match=keys.worker_heartbeat(model, "*")))


async def test_a_second_worker_takes_its_share_and_its_heartbeat_dies_with_it(stack: Stack) -> None:
    """A fault test, on the simulated engine: two workers of one model share its queue (the twin has two slots:
    it may take at most two jobs at a time, the rest stay for the first); the twin killed, its heartbeat expires
    within its TTL (2 s) and the model stays served by the other."""
    edge = stack.edge()
    first = stack.worker(max_num_seqs=8, sim_itl_ms=20)
    twin = stack.worker(max_num_seqs=2, sim_itl_ms=20)
    beats = _heartbeats(stack.client, stack.model)
    assert len(beats) == 2, beats
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        await asyncio.gather(*(
            client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "the ocean"}],
                                           max_tokens=24, timeout=60)
            for _ in range(12)
        ))
        shares = [_finished_jobs(first.metrics_url), _finished_jobs(twin.metrics_url)]
        assert sum(shares) == 12
        assert all(share > 0 for share in shares), shares

        stack.kill(twin.process)  # as when its container dies
        killed = time.monotonic()
        survivor = {beat for beat in beats if f"-{twin.process.pid}-".encode() not in beat}
        assert len(survivor) == 1, beats
        while _heartbeats(stack.client, stack.model) != survivor:
            assert time.monotonic() - killed < 5, "the dead worker's heartbeat did not expire"
            await asyncio.sleep(0.2)
        assert stack.model in [m.id async for m in client.models.list()]
        answer = await client.chat.completions.create(model=stack.model, max_tokens=3,
                                                      messages=[{"role": "user", "content": "still there?"}])
        assert answer.usage is not None and answer.usage.completion_tokens == 3


@pytest.mark.engine
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
    # gone for now, not unknown: a 503 to retry (its worker may be restarting), until edges prune its registry
    # entry (PRUNE_AFTER_S after its heartbeat lapsed; done here at once), then a 404
    once = client.with_options(max_retries=0)
    with pytest.raises(openai.InternalServerError) as resting:
        await once.completions.create(model=model, prompt="count", max_tokens=3)
    assert resting.value.status_code == 503 and resting.value.code == "model_unavailable"
    assert resting.value.response.headers["Retry-After"]
    _prune(redis_client, model)
    with pytest.raises(openai.NotFoundError):
        await once.completions.create(model=model, prompt="count", max_tokens=3)
    # a worker that stops on purpose (SIGTERM) leaves its registry entry too: its model rests, a 503
    with running_worker(redis_url, redis_client, log, model, engine="sim", heartbeat_ttl_s=2,
                        heartbeat_interval_s=0.5) as sim:
        reply = await client.completions.create(model=model, prompt="count", max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        sim.process.send_signal(signal.SIGTERM)
        assert sim.process.wait(timeout=20) == 0
        stopped = time.monotonic()
        while model in [m.id async for m in client.models.list()]:
            assert time.monotonic() - stopped < 2 + 3, "the stopped worker's model is still listed"
            await asyncio.sleep(0.2)
    with pytest.raises(openai.InternalServerError) as resting:
        await once.completions.create(model=model, prompt="count", max_tokens=3)
    assert resting.value.code == "model_unavailable"
    _prune(redis_client, model)  # the session's other tests know no such model


def _prune(redis_client: redis.Redis, model: str) -> None:
    """Takes the model's workers out of the registry, as edges do PRUNE_AFTER_S after their heartbeats lapsed."""
    for name in redis_client.zrange(keys.WORKERS, 0, -1):
        if name.startswith(f"tokenbus:worker:{model}:".encode()):
            redis_client.zrem(keys.WORKERS, name)
