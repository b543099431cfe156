"""The edge's job queue against a real Redis: a burst of jobs goes out in one write, failures reach callers."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.edge.enqueue import JobQueue
from services.supervisor import RedisServer, free_port
from shared import bus, redis_clients


async def test_a_burst_of_jobs_lands_in_order_in_one_round_trip(redis_url: str, redis_client: redis.Redis) -> None:
    client = redis_clients.pooled(redis_url, "test-enqueue", 2)
    writes = 0
    pipeline = client.pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal writes
        writes += 1
        return pipeline(*args, **kwargs)

    client.pipeline = counted  # type: ignore[method-assign]
    queue = JobQueue(client)
    stream = f"test-jobs-{uuid.uuid4().hex}"
    try:
        await asyncio.gather(*(queue.put(stream, f"job-{i}".encode()) for i in range(50)))
    finally:
        await client.aclose()
    entries = redis_client.xrange(stream)
    assert [fields[bus.JOB_FIELD] for _id, fields in entries] == [f"job-{i}".encode() for i in range(50)]
    assert writes == 1


async def test_an_unreachable_redis_fails_every_waiting_put() -> None:
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    queue = JobQueue(client)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(queue.put("jobs", b"x") for _ in range(3)), return_exceptions=True), 10)
    finally:
        await client.aclose()
    assert all(isinstance(r, RedisError) for r in results), results


async def test_jobs_fail_fast_when_redis_dies_under_held_connections(tmp_path: Path) -> None:
    server = RedisServer(str(tmp_path))
    client = redis_clients.pooled(server.start(), "test-enqueue-gone", 2)
    queue = JobQueue(client)
    try:
        await queue.put("s", b"job", ("record", b"value", 1000))  # the pool now holds a live connection
        server.kill()
        results = await asyncio.wait_for(asyncio.gather(
            queue.put("s", b"job", ("record", b"value", 1000)), queue.put("s", b"job"), return_exceptions=True), 5)
    finally:
        await client.aclose()
        server.stop()
    assert all(isinstance(result, RedisError) for result in results), results
