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

from services.supervisor import free_port
from shared.protocol import keys
from tests.processes import MODEL, WorkerProcess, metric_value, process_env, running_worker, spawn_process, stop_process

pytestmark = pytest.mark.engine


def _finished_jobs(metrics_url: str) -> float:
    return metric_value(httpx.get(metrics_url).text, "tokenbus_worker_jobs_total", {"outcome": "finished"})


def _heartbeats(redis_client: redis.Redis) -> set[bytes]:
    return set(redis_client.scan_iter(match=keys.worker_heartbeat(MODEL, "*")))


async def test_a_second_worker_takes_its_share_and_its_heartbeat_dies_with_it(
    client: openai.AsyncOpenAI, worker: WorkerProcess, redis_url: str, redis_client: redis.Redis,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    first_beats = _heartbeats(redis_client)
    metrics_port = free_port()
    log = tmp_path_factory.mktemp("second-worker") / "worker.log"
    # two slots: it may take at most two jobs at a time, the rest stay for the first worker
    env = process_env(redis_url, metrics_port=metrics_port, max_num_seqs=2, kv_cache_gib=1, heartbeat_ttl_s=2,
                      heartbeat_interval_s=0.5)
    second = spawn_process("worker", env, log)
    second_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        deadline = time.monotonic() + 400
        while len(_heartbeats(redis_client)) < len(first_beats) + 1:
            assert second.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.5)
        before = (_finished_jobs(worker.metrics_url), _finished_jobs(second_metrics))
        prompt = [{"role": "user", "content": "Tell me about the ocean."}]
        await asyncio.gather(*(
            client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=24, timeout=120,
                                           extra_body={"ignore_eos": True})
            for _ in range(12)
        ))
        after = (_finished_jobs(worker.metrics_url), _finished_jobs(second_metrics))
        shares = [b - a for a, b in zip(before, after, strict=True)]
        assert sum(shares) == 12
        assert all(share > 0 for share in shares), shares

        os.killpg(second.pid, signal.SIGKILL)  # as when its container dies: the engine goes too
        second.wait(timeout=10)
        killed = time.monotonic()
        while _heartbeats(redis_client) != first_beats:
            assert time.monotonic() - killed < 5, "the dead worker's heartbeat did not expire"
            await asyncio.sleep(0.2)
        assert MODEL in [m.id async for m in client.models.list()]
    finally:
        stop_process(second)


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
