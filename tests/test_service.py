"""The service around the token path: models, health, readiness, metrics, the bus's promises."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis

from shared.protocol import bus, keys
from tests.channel import listening
from tests.processes import EMBEDDING_MODEL, MODEL, Edge, WorkerProcess, metric_samples, metric_value

pytestmark = pytest.mark.engine


async def test_models_lists_the_live_model(client: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in client.models.list()]
    assert MODEL in models


async def test_health_ready_and_metrics(served: Edge) -> None:
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/ready")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready"}
        assert (await http.get("/metrics")).status_code == 404  # the metrics are on a port of their own
        text = (await http.get(served.metrics_url)).text
    assert metric_value(text, "tokenbus_edge_requests_total", {"route": "/v1/chat/completions",
                                                                "status": "200"}) >= 1
    assert metric_value(text, "tokenbus_edge_time_to_first_token_seconds_count", {"model": MODEL}) >= 1
    assert metric_value(text, "tokenbus_edge_live_workers", {"model": MODEL}) >= 1
    assert metric_value(text, "tokenbus_edge_ready") == 1


async def test_the_worker_reports_what_its_engine_holds_and_the_edge_what_streams_did(
    client: openai.AsyncOpenAI, served: Edge, worker: WorkerProcess
) -> None:
    """While a long answer streams, the worker's gauges show the engine's running sequence and its KV cache
    (read from vLLM's scheduler); then the edge has counted its tokens, token gaps and finish reason. Each
    process exports only its own series, none of them `_created`."""
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                                  max_tokens=120, temperature=0, stream=True)
    seen: dict[str, float] = {}
    async with httpx.AsyncClient() as http:
        async for _chunk in stream:
            text = (await http.get(worker.metrics_url)).text
            for name in ("tokenbus_worker_engine_running_sequences", "tokenbus_worker_kv_cache_usage_ratio"):
                seen[name] = max(seen.get(name, 0.0), metric_value(text, name, {"model": MODEL}))
        worker_text = text
        edge_text = (await http.get(served.metrics_url)).text
    assert seen["tokenbus_worker_engine_running_sequences"] >= 1 and seen["tokenbus_worker_kv_cache_usage_ratio"] > 0
    assert metric_value(edge_text, "tokenbus_edge_inter_token_latency_seconds_count", {"model": MODEL}) >= 100
    assert metric_value(edge_text, "tokenbus_edge_prompt_tokens_total", {"model": MODEL}) > 0
    assert metric_value(edge_text, "tokenbus_edge_finish_reasons_total", {"model": MODEL, "reason": "length"}) >= 1
    for name in ("tokenbus_stream_length", "tokenbus_stream_pending"):  # any value, queues drain: the series shows
        assert len(metric_samples(worker_text, name, {"model": MODEL})) == 1, name
    assert "\ntokenbus_worker_" not in "\n" + edge_text and "\ntokenbus_edge_" not in "\n" + worker_text
    assert "_created" not in edge_text + worker_text


VLLM_RAW_PROMPT_WARNING = "Passing raw prompts to InputProcessor is deprecated"
"""What vLLM 0.32 logs (once) when it is handed a bare `{"prompt_token_ids": ...}`: a path it says it will remove."""


async def test_the_engines_take_their_prompts_as_vllm_s_own_inputs(client: openai.AsyncOpenAI, served: Edge,
                                                                   worker: WorkerProcess,
                                                                   embedder: WorkerProcess) -> None:
    """A chat answer, a completion and an embedding reach their engines as vLLM's own token inputs, counted in the
    engines' own time-to-first-token figures (from the job's take-up on the worker), and vLLM never warns of the
    deprecated raw-prompt path it will remove."""
    async with httpx.AsyncClient() as http:
        before = metric_value((await http.get(worker.metrics_url)).text, "vllm:time_to_first_token_seconds_count")
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2)
        embedded = await client.embeddings.create(model=EMBEDDING_MODEL, input="hello world")
        after = metric_value((await http.get(worker.metrics_url)).text, "vllm:time_to_first_token_seconds_count")
    assert len(embedded.data[0].embedding) > 0
    assert after - before >= 2
    for process in (worker, embedder):
        assert VLLM_RAW_PROMPT_WARNING not in process.log.read_text(errors="replace"), process.log


async def test_the_worker_counts_its_engines_prefix_cache_hits(client: openai.AsyncOpenAI,
                                                                worker: WorkerProcess) -> None:
    """The same long prompt twice: the second's prefill finds its leading blocks in vLLM's prefix cache, and
    the worker's counters (read from the engine's own figures) say so."""
    def counts(text: str) -> tuple[float, float]:
        return (metric_value(text, "tokenbus_worker_prefix_cache_queries_total", {"model": MODEL}),
                metric_value(text, "tokenbus_worker_prefix_cache_hits_total", {"model": MODEL}))

    prompt = " ".join(f"fact {i} is that the sea is deep." for i in range(40))
    async with httpx.AsyncClient() as http:
        before = counts((await http.get(worker.metrics_url)).text)
        for _ in range(2):
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        await asyncio.sleep(1.5)  # vLLM reports its figures each engine step, and once a second when idle
        after = counts((await http.get(worker.metrics_url)).text)
    queried, hit = after[0] - before[0], after[1] - before[1]
    assert queried >= 2 * 300 and hit >= 256, (queried, hit)  # the second prompt's blocks, all but the last


def _edge_connections(redis_client: redis.Redis) -> int:
    return sum(1 for c in redis_client.client_list() if c.get("name", "").startswith("tokenbus-edge-"))


async def test_an_edge_keeps_a_fixed_number_of_redis_connections(
    client: openai.AsyncOpenAI, redis_client: redis.Redis
) -> None:
    async def one() -> None:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}], stream=True,
            max_tokens=30,
        )
        async for _ in stream:
            pass

    streams = [asyncio.create_task(one()) for _ in range(24)]
    await asyncio.sleep(1.0)
    during = _edge_connections(redis_client)
    await asyncio.gather(*streams)
    # its fixed set, for 24 streams at once: the relay's reader, the key-change listener and the pool of 4 (one of
    # them held by the job queue)
    assert 1 <= during <= 6


def _job(reply_to: str, deadline_ms: int, *, queued_ms: int = 5000, max_tokens: int = 5) -> bus.Job:
    """A job as an edge would enqueue it, `queued_ms` ago."""
    return bus.Job(id=f"test-{uuid.uuid4().hex}", model=MODEL, reply_to=reply_to, deadline_ms=deadline_ms,
                   messages=[bus.Message(role="user", content="Hi")],
                   params=bus.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   created_ms=bus.now_ms() - queued_ms)


def test_a_job_expired_in_the_queue_never_starts(redis_client: redis.Redis, worker: WorkerProcess) -> None:
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    job = _job(reply_to, deadline_ms=bus.now_ms() - 1)
    with listening(redis_client, reply_to) as listener:
        redis_client.xadd(keys.requests_stream(MODEL), {bus.JOB_FIELD: bus.encode_job(job)})
        events = [e for _t, e in listener.events(wait_s=10)]
    assert [type(e) for e in events] == [bus.Error]
    assert events[0].kind == "RequestTimeout"


def test_a_worker_serving_adapters_refuses_to_score_a_prompt_and_serves_on(
    redis_client: redis.Redis, worker: WorkerProcess
) -> None:
    """A job that asks for its prompts' logprobs reaching a worker with LoRA enabled (an edge that did not know of it
    yet) is refused: vLLM computing them there fails its engine core once a step holds two requests (vLLM issues
    29955, 16668), and with it every tenant's streams. The worker serves the next job."""
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    scoring = bus.Job(id=f"test-{uuid.uuid4().hex}", model=MODEL, reply_to=reply_to, kind="completion",
                      deadline_ms=bus.now_ms() + 60_000, prompts=["The capital of France is", "One, two,"],
                      params=bus.SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1), created_ms=bus.now_ms())
    after = _job(reply_to, deadline_ms=bus.now_ms() + 60_000, queued_ms=0)
    with listening(redis_client, reply_to) as listener:
        redis_client.xadd(keys.requests_stream(MODEL), {bus.JOB_FIELD: bus.encode_job(scoring)})
        refused = [e for _t, e in listener.events(wait_s=10) if e.job == scoring.id]
        redis_client.xadd(keys.requests_stream(MODEL), {bus.JOB_FIELD: bus.encode_job(after)})
        served = [e for _t, e in listener.events(wait_s=30) if e.job == after.id]
    assert isinstance(refused[-1], bus.Error) and not any(isinstance(e, bus.Tokens) for e in refused), refused
    assert refused[-1].code == "prompt_logprobs_unavailable" and refused[-1].param == "logprobs"
    assert isinstance(served[-1], bus.Final) and served[-1].completion_tokens == 5


def test_a_job_cancelled_in_the_queue_never_starts(redis_client: redis.Redis, worker: WorkerProcess) -> None:
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    job = _job(reply_to, deadline_ms=bus.now_ms() + 60_000)
    cancelled = {"outcome": "cancelled"}
    before = metric_value(httpx.get(worker.metrics_url).text, "tokenbus_worker_jobs_total", cancelled)
    redis_client.set(keys.cancelled(job.id), 1, ex=60)
    with listening(redis_client, reply_to) as listener:
        redis_client.xadd(keys.requests_stream(MODEL), {bus.JOB_FIELD: bus.encode_job(job)})
        deadline = time.monotonic() + 10
        while metric_value(httpx.get(worker.metrics_url).text, "tokenbus_worker_jobs_total", cancelled) == before:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert listener.events(wait_s=0.5) == []


def test_a_fresh_job_whose_cancel_the_channel_missed_is_aborted_at_once(
    redis_client: redis.Redis, worker: WorkerProcess
) -> None:
    """Fresh jobs start without waiting for the cancel check (it is off the time-to-first-token path); a mark
    the cancel channel did not deliver still stops the job before it runs far."""
    reply_to = keys.events_channel(f"test-{uuid.uuid4().hex}")
    job = _job(reply_to, deadline_ms=bus.now_ms() + 60_000, queued_ms=0, max_tokens=500)
    aborted = {"outcome": "aborted"}
    before = metric_value(httpx.get(worker.metrics_url).text, "tokenbus_worker_jobs_total", aborted)
    redis_client.set(keys.cancelled(job.id), 1, ex=60)  # marked, but never published on the channel
    with listening(redis_client, reply_to) as listener:
        redis_client.xadd(keys.requests_stream(MODEL), {bus.JOB_FIELD: bus.encode_job(job)})
        deadline = time.monotonic() + 10
        while metric_value(httpx.get(worker.metrics_url).text, "tokenbus_worker_jobs_total", aborted) == before:
            assert time.monotonic() < deadline, "the job was not aborted"
            time.sleep(0.05)
        published = [e for _t, e in listener.events(wait_s=0.5)]  # nobody listens after an abort: no Final
    assert sum(len(e.token_ids) for e in published if isinstance(e, bus.Tokens)) < 50


def test_tokens_are_published_in_batches(redis_client: redis.Redis, worker: WorkerProcess, served: Edge) -> None:
    """With several streams at once, one Redis write carries the tokens of many of them."""
    text = httpx.get(worker.metrics_url).text
    flushes, events = (metric_value(text, "tokenbus_worker_event_flushes_total"),
                       metric_value(text, "tokenbus_worker_events_published_total"))
    def one(_: int) -> None:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a story."}],
                                       max_tokens=20, temperature=0.8, extra_body={"ignore_eos": True})

    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client, \
            ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))
    text = httpx.get(worker.metrics_url).text
    new_flushes = metric_value(text, "tokenbus_worker_event_flushes_total") - flushes
    new_events = metric_value(text, "tokenbus_worker_events_published_total") - events
    assert new_events >= 8 * 20
    assert new_events / new_flushes > 2
