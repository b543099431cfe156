"""tokenbus on a Redis Cluster: three masters (redis-server processes on loopback, `redis-cli --cluster
create`), two edges with API keys and a `--engine sim` worker started with `--redis-cluster`, the keys made
with `tokenbus keys --redis-cluster`. Streams, a stream resumed on the other edge, a cancel, stored
responses read on either edge and continued with previous_response_id, and a rate limit all work through
it, and nothing stays pending."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from services.supervisor import free_port, private_redis_cluster
from shared.protocol import keys
from tests.processes import ROOT, Edge, metric_value, process_env, spawn_process, start_edge, stop_process
from tests.stack import FAST_BEATS

MODEL = "cluster-model"


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with private_redis_cluster(3) as url:
        yield url


@pytest.fixture(scope="module")
def services(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Edge], str]]:
    root = tmp_path_factory.mktemp("cluster")
    settings: dict[str, Any] = {"model": MODEL, "redis_cluster": "true", **FAST_BEATS}
    metrics_port = free_port()
    env = process_env(cluster, engine="sim", metrics_port=metrics_port, **settings)
    worker = spawn_process("worker", env, root / "worker.log")
    edges = [start_edge(cluster, root, f"edge{i}", auth="keys", resume_window_s=5, **settings) for i in range(2)]
    try:
        deadline = time.monotonic() + 30
        while httpx.get(edges[0].url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, (root / "worker.log").read_text()[-2000:]
            time.sleep(0.2)
        yield edges, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        for edge in edges:
            stop_process(edge.process)
        stop_process(worker)


def make_key(cluster: str, *options: str) -> str:
    made = subprocess.run([sys.executable, "-m", "services.cli", "keys", "--json", "--redis-cluster",
                           "--redis-url", cluster, "create", *options], cwd=ROOT, capture_output=True, text=True,
                          timeout=30)
    assert made.returncode == 0, made.stderr
    key: str = json.loads(made.stdout)["key"]
    return key


def client(edge: Edge, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=key, max_retries=0, timeout=30)


async def test_streams_resumes_cancels_and_stored_responses_work_on_a_cluster(
    cluster: str, services: tuple[list[Edge], str]
) -> None:
    edges, worker_metrics = services
    key = make_key(cluster, "--tenant", "cluster")
    async with client(edges[0], key) as first, client(edges[1], key) as second:
        await serve_everything(edges, worker_metrics, key, first, second)
    nodes = AsyncRedisCluster.from_url(cluster)
    try:
        deadline = time.monotonic() + 10
        while (pending := (await nodes.xpending(keys.requests_stream(MODEL), keys.WORKER_GROUP))["pending"]) > 0:
            assert time.monotonic() < deadline, f"{pending} entries still pending"
            await asyncio.sleep(0.2)
    finally:
        await nodes.aclose()


async def serve_everything(edges: list[Edge], worker_metrics: str, key: str, first: openai.AsyncOpenAI,
                           second: openai.AsyncOpenAI) -> None:
    """Streams, a resume, a client that leaves, stored responses: through both edges (`first`, `second`)."""

    async def stream(sdk: openai.AsyncOpenAI, tokens: int) -> str:
        chunks = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                                   max_tokens=tokens, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    texts = await asyncio.gather(*(stream(sdk, 20) for sdk in (first, second) for _ in range(8)))
    assert texts == ["".join(f" t{n}" for n in range(1, 21))] * 16

    # a stream cut after a few events resumes on the other edge from where it was
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 30, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        last = ""
        async with http.stream("POST", edges[0].url + "/v1/chat/completions", json=body,
                               headers={**headers, "Accept": "text/event-stream"}) as cut:
            async for line in cut.aiter_lines():
                if line.startswith("id: "):
                    last = line[4:]
                    if last.endswith(":5"):
                        break
        stream_id = last.rsplit(":", 1)[0]
        rest = await http.get(f"{edges[1].url}/v1/streams/{stream_id}", headers={**headers, "Last-Event-ID": last})
        assert rest.status_code == 200 and '"finish_reason":"length"' in rest.text.replace(" ", "")

    # a client that leaves for good: its job is stopped once the resume window is over
    async with httpx.AsyncClient(timeout=10) as http:
        before = await aborted(http, worker_metrics)
    leaving = asyncio.create_task(stream(first, 2000))
    await asyncio.sleep(0.5)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    deadline = time.monotonic() + 20
    async with httpx.AsyncClient(timeout=10) as http:
        while await aborted(http, worker_metrics) == before:
            assert time.monotonic() < deadline, "the left stream's job was never stopped"
            await asyncio.sleep(0.2)

    # stored responses: made on one edge, read and continued on the other
    made = await first.responses.create(model=MODEL, input="count", max_output_tokens=5)
    again = await second.responses.retrieve(made.id)
    assert again.output_text == made.output_text == " t1 t2 t3 t4 t5"
    follow = await second.responses.create(model=MODEL, input="more", max_output_tokens=3,
                                           previous_response_id=made.id)
    assert (follow.previous_response_id, follow.output_text) == (made.id, " t1 t2 t3")  # the sim counts to its budget
    # items of both, referenced on the first edge: read from the cluster in one step
    ids = [str(made.output[0].id), str(follow.output[0].id)]
    referenced = await first.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"type": "item_reference", "id": item} for item in ids])
    assert [item.id async for item in first.responses.input_items.list(referenced.id, order="asc")] == ids


async def aborted(http: httpx.AsyncClient, metrics_url: str) -> float:
    return metric_value((await http.get(metrics_url)).text, "tokenbus_worker_jobs_total", {"outcome": "aborted"})


async def test_a_rate_limit_holds_across_both_edges_on_a_cluster(
    cluster: str, services: tuple[list[Edge], str]
) -> None:
    edges, _metrics = services
    key = make_key(cluster, "--tenant", "limited", "--rpm", "5")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as http:
        answers = await asyncio.gather(*(http.post(edges[i % 2].url + "/v1/chat/completions", json=body,
                                                   headers={"Authorization": f"Bearer {key}"}) for i in range(12)))
    assert sorted(a.status_code for a in answers) == [200] * 5 + [429] * 7
    revoked = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "keys", "--redis-cluster", "--redis-url", cluster,
                         "revoke", key_id(cluster, "limited")], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert revoked.returncode == 0, revoked.stderr
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(timeout=30) as http:
        gone = await http.post(edges[1].url + "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"})
    assert gone.status_code == 401


def key_id(cluster: str, tenant: str) -> str:
    listed = subprocess.run([sys.executable, "-m", "services.cli", "keys", "--json", "--redis-cluster",
                             "--redis-url", cluster, "list"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    found: list[dict[str, Any]] = json.loads(listed.stdout)
    return next(str(k["id"]) for k in found if k["tenant"] == tenant)


def test_the_cluster_helper_gives_three_masters(cluster: str) -> None:
    nodes = RedisCluster.from_url(cluster)
    try:
        assert len(nodes.get_primaries()) == 3
    finally:
        nodes.close()


