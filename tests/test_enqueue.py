"""The edge's job queue against a real Redis: a job goes out on the spot, the rest of a burst in one write after it,
refusals and failures reach callers."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.edge.enqueue import JobQueue
from services.supervisor import RedisServer, free_port
from shared.protocol import bus, keys
from shared.protocol.errors import QueueFull
from shared.redisio import clients as redis_clients
from shared.runtime.settings import Settings
from shared.tenancy import fairshare


def job(model: str, i: int = 0) -> bus.Job:
    return bus.Job(id=f"job-{i}", model=model, reply_to="events", deadline_ms=bus.now_ms() + 60_000)


def queue_of(client: aioredis.Redis, scheduler: str = "fair", **settings: Any) -> JobQueue:
    return JobQueue(client, fairshare.for_settings(client, Settings(scheduler=scheduler, **settings)))


def counting_writes(pipelines: Any) -> list[int]:
    """Counts the pipelines made by `pipelines` (a client, or a rawpipe.Pipelines): one round trip each."""
    writes = [0]
    pipeline = pipelines.pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        writes[0] += 1
        return pipeline(*args, **kwargs)

    pipelines.pipeline = counted
    return writes


async def test_a_burst_of_jobs_lands_in_order_in_two_round_trips(redis_url: str, redis_client: redis.Redis) -> None:
    """The first job of the burst is written at once; the others, which arrive while it is in flight, together."""
    client = redis_clients.pooled(redis_url, "test-enqueue", 2)
    queue = queue_of(client, "fifo")
    await queue.scheduler.load()
    writes = counting_writes(queue.pipelines)
    model = f"test-{uuid.uuid4().hex}"
    try:
        await asyncio.gather(*(queue.put(job(model, i)) for i in range(50)))
    finally:
        await client.aclose()
    entries = redis_client.xrange(keys.requests_stream(model))
    assert [bus.decode_job(fields[bus.JOB_FIELD]).id for _id, fields in entries] == [f"job-{i}" for i in range(50)]
    assert writes == [2]


async def test_a_job_is_written_in_the_step_of_its_request(redis_url: str, redis_client: redis.Redis) -> None:
    """With the connection up and nothing in flight, a put writes its job before its request's task yields: nothing
    else the loop has ready runs first."""
    client = redis_clients.pooled(redis_url, "test-enqueue", 2)
    queue = queue_of(client, "fifo")
    model = f"test-{uuid.uuid4().hex}"
    try:
        await queue.put(job(model, 0))  # the queue now holds its connection
        put = asyncio.create_task(queue.put(job(model, 1)))
        await asyncio.sleep(0)  # the put's first step runs, and nothing after it
        deadline = asyncio.get_running_loop().time() + 5
        while redis_client.xlen(keys.requests_stream(model)) < 2:  # blocking reads: this loop runs nothing meanwhile
            assert asyncio.get_running_loop().time() < deadline, "the job was not written in its request's step"
        assert isinstance(await put, fairshare.Admitted)
    finally:
        await client.aclose()


async def test_the_fair_queue_takes_a_burst_in_order_after_redis_lost_its_scripts(
        redis_url: str, redis_client: redis.Redis) -> None:
    """The first write finds no scripts (NOSCRIPT): they are loaded and the burst is sent once more, in order."""
    client = redis_clients.pooled(redis_url, "test-enqueue", 2)
    redis_client.script_flush()
    queue = queue_of(client)
    model = f"test-{uuid.uuid4().hex}"
    writes = counting_writes(queue.pipelines)
    try:
        admitted = await asyncio.gather(*(queue.put(job(model, i)) for i in range(50)))
        await asyncio.gather(*(queue.put(job(model, i)) for i in range(50, 60)))
    finally:
        await client.aclose()
    assert all(isinstance(a, fairshare.Admitted) for a in admitted)
    members = redis_client.zrange(keys.fair_key(model, "backlog"), 0, -1)
    queued = redis_client.hmget(keys.fair_key(model, "jobs"), members)
    assert [bus.decode_job(data).id for data in queued] == [f"job-{i}" for i in range(60)]
    assert writes == [4]  # the burst's first job (NOSCRIPT), it again with the rest, then the next burst in two


async def test_a_refused_job_raises_and_leaves_neither_job_nor_resume_record(
        redis_url: str, redis_client: redis.Redis) -> None:
    client = redis_clients.pooled(redis_url, "test-enqueue", 2)
    queue = queue_of(client, max_queued_jobs=1)
    model = f"test-{uuid.uuid4().hex}"
    try:
        await queue.put(job(model, 0))
        with pytest.raises(QueueFull):
            await queue.put(job(model, 1), (f"record-{model}", b"body", 60_000))
        assert queue.writer is not None
        await queue.writer  # it removes the refused job's record after the refusal reached its caller
    finally:
        await client.aclose()
    assert redis_client.zcard(keys.fair_key(model, "backlog")) == 1
    assert not redis_client.exists(f"record-{model}")


async def test_an_unreachable_redis_fails_every_waiting_put() -> None:
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    queue = queue_of(client)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(queue.put(job("m")) for _ in range(3)), return_exceptions=True), 10)
    finally:
        await client.aclose()
    assert all(isinstance(r, RedisError) for r in results), results


async def test_jobs_fail_fast_when_redis_dies_under_held_connections(tmp_path: Path) -> None:
    server = RedisServer(str(tmp_path))
    client = redis_clients.pooled(server.start(), "test-enqueue-gone", 2)
    queue = queue_of(client)
    try:
        await queue.put(job("m"), ("record", b"value", 1000))  # the pool now holds a live connection
        server.kill()
        results = await asyncio.wait_for(asyncio.gather(
            queue.put(job("m"), ("record", b"value", 1000)), queue.put(job("m")), return_exceptions=True), 5)
    finally:
        await client.aclose()
        server.stop()
    assert all(isinstance(result, RedisError) for result in results), results



async def test_the_first_job_after_a_redis_restart_is_queued(tmp_path: Path) -> None:
    """Every pooled connection died idle with the old Redis, which also took the scripts: the put reconnects,
    reloads them and lands, rather than failing the first request after a restart."""
    server = RedisServer(str(tmp_path))
    url = server.start()
    client = redis_clients.pooled(url, "test-enqueue-restart", 2)
    queue = queue_of(client)
    try:
        await queue.scheduler.load()
        await asyncio.gather(client.ping(), client.ping())  # the pool now holds two live connections
        await queue.put(job("m", 0))
        server.kill()
        server.start()  # on the same port, with the queued job (its append-only file) but without the scripts
        admitted = await asyncio.wait_for(queue.put(job("m", 1)), 15)
        queued = await client.hvals(keys.fair_key("m", "jobs"))
    finally:
        await client.aclose()
        server.stop()
    assert isinstance(admitted, fairshare.Admitted)
    assert sorted(bus.decode_job(data).id for data in queued) == ["job-0", "job-1"]
