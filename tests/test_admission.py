"""Admission control and the fair scheduler end to end: separate edge, simulated worker and Redis processes
(tests.stack), requests through the public API. Tenant against tenant is in tests/test_fairness.py."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

import httpx
import orjson
import redis.asyncio as aioredis

from shared.protocol import keys
from shared.tenancy import apikeys
from tests.processes import WorkerProcess, metric_value
from tests.stack import Stack
from tests.test_faults import chat_body, expected, sse_frames, stream_text


async def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    async with httpx.AsyncClient() as http:
        return metric_value((await http.get(url)).text, name, labels)


def queued(stack: Stack) -> int:
    return int(stack.client.hget(keys.fair_key(stack.model, "state"), "queued") or 0)


async def running(worker: WorkerProcess) -> float:
    return await metric(worker.metrics_url, "tokenbus_worker_running_jobs")


async def wait_for(condition: str, check: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Polls `check` (it may return an awaitable) until it is true."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {condition}"
        await asyncio.sleep(0.05)


def streamed_text(frames: list[tuple[str, str]]) -> str:
    chunks = [orjson.loads(data) for _id, data in frames if data != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


async def test_a_tenant_alone_keeps_every_slot_busy(stack: Stack) -> None:
    """Work conservation: 48 streams of 2 s for 16 slots run in three full waves, as fast as FIFO would (a
    freed slot that waited for the worker's next read would cost up to a second each time)."""
    edge = stack.edge()
    worker = stack.worker(max_num_seqs=16, heartbeat_interval_s=2, heartbeat_ttl_s=6)  # no dispatch from beats

    async def all_busy() -> bool:
        return await running(worker) == 16

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
        started = time.monotonic()
        streams = [asyncio.create_task(sse_frames(http, "POST", edge.url + "/v1/chat/completions",
                                                  json=chat_body(stack.model, 100))) for _ in range(48)]
        await wait_for("every slot busy", all_busy)
        results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        elapsed = time.monotonic() - started
    assert all(streamed_text(frames) == expected(100) for frames in results)
    ideal = 3 * (0.05 + 100 * 0.02)  # measured with FIFO on a 2-core machine: 6.2 to 6.3 s
    assert elapsed < ideal * 1.2, f"{elapsed:.1f} s for three waves of {ideal / 3:.2f} s"
    await stack.settled()


async def test_a_job_that_waited_past_the_queue_timeout_is_never_started(stack: Stack) -> None:
    edge = stack.edge()
    worker = stack.worker(max_num_seqs=1, queue_timeout_s=1)
    first = asyncio.create_task(stream_text(edge.url, stack.model, 100))  # holds the only slot for 2 s
    await wait_for("the first job running", lambda: running(worker))
    async with httpx.AsyncClient(timeout=30) as http:
        late = await http.post(edge.url + "/v1/chat/completions", json=chat_body(stack.model, 5))
    assert late.status_code == 503 and late.headers["Retry-After"]
    error = late.json()["error"]
    assert error["code"] == "queue_timeout" and "queue timeout" in error["message"]
    assert await first == (expected(100), 100)
    assert await metric(worker.metrics_url, "tokenbus_worker_jobs_total", {"outcome": "queue_timeout"}) == 1
    await stack.settled()


async def test_past_the_bounds_requests_are_refused_at_once_and_nothing_is_queued(stack: Stack) -> None:
    """One slot held, one job queued: the model's bound answers 503 and the tenant's bound 429, with
    Retry-After, in the route's error shape (OpenAI and TGI), and neither refused request is queued."""
    tight = stack.edge(max_queued_jobs=1)
    per_tenant = stack.edge(max_queued_per_tenant=1)
    stack.worker(max_num_seqs=1)
    async with httpx.AsyncClient(timeout=30) as http:
        running = asyncio.create_task(sse_frames(http, "POST", tight.url + "/v1/chat/completions",
                                                 json=chat_body(stack.model, 100)))
        await wait_for("the first job on its way", stack.on_streams)
        waiting = asyncio.create_task(sse_frames(http, "POST", tight.url + "/v1/chat/completions",
                                                 json=chat_body(stack.model, 5)))
        await wait_for("the second job queued", lambda: queued(stack) == 1)
        answers = {}
        for name, edge in (("model", tight), ("tenant", per_tenant)):
            began = time.monotonic()
            answers[name] = await http.post(edge.url + "/v1/chat/completions", json=chat_body(stack.model, 5))
            assert time.monotonic() - began < 1.0
        tgi = await http.post(tight.url + "/generate", json={"inputs": "count", "parameters": {"max_new_tokens": 5}})
        assert queued(stack) == 1
        await asyncio.wait_for(asyncio.gather(running, waiting), 30)
    assert answers["model"].status_code == 503 and answers["model"].json()["error"]["code"] == "queue_full"
    assert answers["tenant"].status_code == 429 and answers["tenant"].json()["error"]["code"] == "tenant_queue_full"
    assert all(int(answer.headers["Retry-After"]) >= 1 for answer in answers.values())
    assert tgi.status_code == 429 and tgi.json()["error_type"] == "overloaded" and tgi.headers["Retry-After"]
    refusals = await metric(tight.metrics_url, "tokenbus_edge_admission_refusals_total",
                            {"reason": "queue_full"})
    assert refusals == 2
    await stack.settled()


async def test_a_client_that_leaves_while_queued_takes_its_job_off_the_backlog(stack: Stack) -> None:
    edge = stack.edge()
    worker = stack.worker(max_num_seqs=1)
    async with httpx.AsyncClient(timeout=30) as http:
        first = asyncio.create_task(stream_text(edge.url, stack.model, 100))
        await wait_for("the first job running", lambda: running(worker))
        leaving = asyncio.create_task(sse_frames(http, "POST", edge.url + "/v1/chat/completions",
                                                 json=chat_body(stack.model, 5)))
        await wait_for("the second job queued", lambda: queued(stack) == 1)
        leaving.cancel()
        await wait_for("the backlog emptied", lambda: queued(stack) == 0, timeout_s=2)
        assert stack.client.zcard(keys.fair_key(stack.model, "backlog")) == 0
        assert await first == (expected(100), 100)
    await stack.settled()
    assert await metric(worker.metrics_url, "tokenbus_worker_jobs_total") == 1  # the one that left never ran


async def test_a_request_the_queue_refuses_spends_its_request_and_no_tokens(stack: Stack) -> None:
    """A key with 3 requests a minute: one request runs, one waits, and the tenant's queue bound refuses the third
    (429 tenant_queue_full): its request stays spent, as any refused request's (only its tokens come back). Were it
    given back, a key whose queue is full could send requests as fast as it likes, each read, planned and admitted;
    the next two are refused on the rpm, before their bodies are read."""
    edge = stack.edge(auth="keys", max_queued_per_tenant=1)
    worker = stack.worker(max_num_seqs=1)
    client = aioredis.Redis.from_url(stack.url)
    try:
        key, _record = await apikeys.create(client, apikeys.KeyChanges(tenant="bounded", rpm=3))
    finally:
        await client.aclose()
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        url = edge.url + "/v1/chat/completions"
        first = asyncio.create_task(sse_frames(http, "POST", url, json=chat_body(stack.model, 50)))
        await wait_for("the first job running", lambda: running(worker))
        second = asyncio.create_task(sse_frames(http, "POST", url, json=chat_body(stack.model, 5)))
        await wait_for("the second job queued", lambda: queued(stack) == 1)
        refused = [await http.post(url, json=chat_body(stack.model, 5)) for _ in range(3)]
        await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert [r.json()["error"]["code"] for r in refused] == ["tenant_queue_full"] + ["rate_limit_exceeded"] * 2
    assert [r.json()["error"]["type"] for r in refused[1:]] == ["requests"] * 2
    await stack.settled()
