"""One tenant cannot hurt another, tried as a hostile tenant with a valid key would: real processes (a Redis, two
`tokenbus edge --auth keys`, a simulated worker), every attack from tenant A while tenant B streams."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from shared.protocol import bus, keys
from shared.tenancy import apikeys
from shared.tenancy.limits import Limits, Settlements
from tests.processes import metric_value
from tests.stack import Stack
from tests.test_faults import chat_body, sse_frames
from tests.test_tenancy import bearer, create_key, tokenbus

RESUME_WINDOW_S = 3
MAX_RSS_GROWTH_MB = 300
B_STREAMS = 8
B_SECONDS = 3.0
ROUNDS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("abuse")) as running:
        running.worker(sim_ttft_ms=20, sim_itl_ms=10, max_num_seqs=64, max_model_len=4096)
        for _ in range(2):
            running.edge(auth="keys", lease_ttl_s=3, resume_window_s=RESUME_WINDOW_S)
        yield running


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def running_jobs(stack: Stack) -> float:
    async with httpx.AsyncClient() as http:
        return metric_value((await http.get(stack.workers[0].metrics_url)).text, "tokenbus_worker_running_jobs")


async def until(condition: str, check: Any, timeout_s: float) -> float:
    """Polls the async `check` until it is true; returns how long it took."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {condition}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def b_first_tokens(stack: Stack, key: dict[str, Any], busy: Callable[[], bool]) -> list[float]:
    """Tenant B's times to first token: B_STREAMS clients over both edges, each sending its next stream when
    the last ended, for B_SECONDS at least and while `busy()`; every stream must complete."""
    async def one(http: httpx.AsyncClient, i: int) -> float:
        started = time.monotonic()
        first, done = 0.0, False
        url = stack.edges[i % 2].url + "/v1/chat/completions"
        async with http.stream("POST", url, json=chat_body(stack.model, 20), headers=bearer(key)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content"' in line and not first:
                    first = time.monotonic() - started
                done = done or line == "data: [DONE]"
        assert done and first
        return first

    async def client(http: httpx.AsyncClient, i: int, until: float) -> list[float]:
        found = []
        while time.monotonic() < until or busy():
            found.append(await one(http, i))
        return found

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=B_STREAMS)) as http:
        await asyncio.gather(*(one(http, i) for i in range(B_STREAMS)))  # connections open and warm
        until = time.monotonic() + B_SECONDS
        found = await asyncio.gather(*(client(http, i, until) for i in range(B_STREAMS)))
    return [ttft for each in found for ttft in each]


def flood(urls: list[str], key: str, bodies: list[tuple[str, str, bytes, dict[str, Any]]], rounds: int,
          found: Any) -> None:
    """Tenant A's attacks, from a process of its own (as a real attacker is): each body `rounds` times to each
    edge, one request at a time per edge."""
    async def attack(http: httpx.AsyncClient, url: str, name: str, path: str, content: bytes,
                     headers: dict[str, Any]) -> None:
        answer = await http.post(url + path, content=content, headers={
            "Authorization": f"Bearer {key}", "content-type": "application/json", **headers})
        error = answer.json().get("error") if answer.status_code != 200 else {"message": "ok", "type": "ok"}
        found.put((name, answer.status_code, bool(error and error.get("message") and error.get("type"))))

    async def edge(http: httpx.AsyncClient, url: str) -> None:
        for _ in range(rounds):
            for each in bodies:
                await attack(http, url, *each)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            await asyncio.gather(*(edge(http, url) for url in urls))

    asyncio.run(run())


ARRAYS: list[list[int]] = [[]] * 2_500_000
"""7.5 MB of JSON that is 2.5 million arrays: built into Python objects, ~2 s of an edge's loop."""


def _schema(size: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 10} for i in range(size)}}


def attacks(model: str) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(name, path, body, extra headers) of each request of issue 33 that used to cost an edge or a worker."""
    user = [{"role": "user", "content": "hi"}]
    return [
        ("suffix x prompts x n", "/v1/completions",
         {"model": model, "prompt": ["p"] * 256, "n": 16, "suffix": "s" * 100_000, "max_tokens": 1}, {}),
        ("prompts x n: 4,096 sequences", "/v1/completions",
         {"model": model, "prompt": ["p"] * 256, "n": 16, "max_tokens": 1}, {}),
        ("echo x n", "/v1/completions",
         {"model": model, "prompt": ["p" * 400_000] * 16, "n": 16, "echo": True, "max_tokens": 1}, {}),
        ("instruction x inputs", "/v1/embeddings",
         {"model": model, "input": ["x"] * 2048, "instruction": "i" * 100_000}, {}),
        ("1.1 MB schema", "/v1/chat/completions",
         {"model": model, "messages": user, "response_format": {
             "type": "json_schema", "json_schema": {"name": "s", "schema": _schema(20_000)}}}, {}),
        ("anyOf schema", "/v1/chat/completions",
         {"model": model, "messages": user, "structured_outputs": {
             "json": {"anyOf": [{"type": "integer", "minimum": i} for i in range(2000)]}}}, {}),
        ("32 tools of 60 kB", "/v1/chat/completions",
         {"model": model, "messages": user, "tools": [
             {"type": "function", "function": {"name": f"f{i}", "parameters": _schema(1000)}} for i in range(32)]},
         {}),
        ("logit_bias x 5000", "/v1/chat/completions",
         {"model": model, "messages": user, "logit_bias": {str(i): 1 for i in range(5000)}}, {}),
        ("100k messages", "/v1/chat/completions", {"model": model, "messages": user * 100_000}, {}),
        ("7.5 MB of empty arrays in a refused field", "/v1/chat/completions",
         {"model": model, "messages": user, "audio": ARRAYS}, {}),
        ("max_tokens 2**63", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2**63 - 1}, {}),
        ("Last-Event-ID x:²", "/v1/chat/completions", {"model": model, "messages": user},
         {"Last-Event-ID": "x:²".encode()}),
    ]


async def resume_to_skip_the_concurrency_limit(stack: Stack, key: dict[str, Any]) -> list[int]:
    """Tenant A, `--max-concurrency 1`: opens resumable streams, leaves each after its first bytes and resumes them
    all on the other edge; the statuses of the streams it tried to open while one was left running."""
    url = stack.edges[0].url + "/v1/chat/completions"
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=30) as http:
        # left running ~4 s (its resume window is 3 s): the three tries below find it holding the lease on a busy
        # machine too
        head = await sse_frames(http, "POST", url, json=chat_body(stack.model, 400), headers=bearer(key), limit=2)
        for _ in range(3):
            answer = await http.post(url, json=chat_body(stack.model, 100), headers={
                **bearer(key), "Accept": "text/event-stream"})
            statuses.append(answer.status_code)
        tail = await sse_frames(http, "GET", f"{stack.edges[1].url}/v1/streams/{head[-1][0].rsplit(':', 1)[0]}",
                                headers={**bearer(key), "Last-Event-ID": head[-1][0]})
    assert tail[-1][1] == "[DONE]"
    return statuses


async def fill_the_store(stack: Stack, key: dict[str, Any]) -> list[str]:
    """Tenant A stores responses until its storage quota refuses one: the codes of the refusals."""
    codes = []
    async with openai.AsyncOpenAI(base_url=stack.edges[1].url + "/v1", api_key=key["key"], max_retries=0) as sdk:
        for _ in range(8):
            try:
                await sdk.responses.create(model=stack.model, input="keep this", max_output_tokens=4)
            except openai.RateLimitError as refused:
                codes.append(str(refused.code))
    return codes


async def test_every_attack_gets_a_clean_answer_while_b_streams_unharmed(stack: Stack) -> None:
    a = create_key(stack, "--tenant", "a", "--rpm", "6000")
    a_one = create_key(stack, "--tenant", "a-one", "--max-concurrency", "1")
    a_store = create_key(stack, "--tenant", "a-store", "--storage-items", "3")
    b = create_key(stack, "--tenant", "b")
    alone = await b_first_tokens(stack, b, lambda: False)
    before = [peak_rss_mb(edge.process.pid) for edge in stack.edges]
    bodies = [(name, path, orjson.dumps(body), headers) for name, path, body, headers in attacks(stack.model)]
    spawn = multiprocessing.get_context("spawn")
    found = spawn.Queue()
    attacker = spawn.Process(target=flood, args=([e.url for e in stack.edges], a["key"], bodies, ROUNDS, found))
    attacker.start()
    try:
        under, resumed, stored = await asyncio.gather(
            b_first_tokens(stack, b, attacker.is_alive), resume_to_skip_the_concurrency_limit(stack, a_one),
            fill_the_store(stack, a_store))
        await asyncio.to_thread(attacker.join, 60)
    finally:
        attacker.kill()
    answers = [found.get(timeout=1) for _ in range(ROUNDS * 2 * len(bodies))]
    after = [peak_rss_mb(edge.process.pid) for edge in stack.edges]
    assert all(400 <= status < 500 and shaped for _name, status, shaped in answers), answers
    assert resumed == [429, 429, 429]  # the stream left running still holds the key's one lease
    assert stored == ["storage_quota_exceeded"] * 5
    assert max(b - a for a, b in zip(before, after, strict=True)) < MAX_RSS_GROWTH_MB, (before, after)
    p50_alone, p50_under = statistics.median(alone), statistics.median(under)
    if p50_under > 1.5 * p50_alone:  # the machine's other load may have grown since (CI runs the engine tests
        # beside this module): B alone once more, now that the attack is over, is what the attack is measured by
        p50_alone = max(p50_alone, statistics.median(await b_first_tokens(stack, b, lambda: False)))
    assert p50_under <= 1.5 * p50_alone, f"B's TTFT p50: {p50_under:.3f} s under attack, {p50_alone:.3f} s alone"
    await stack.settled()


async def test_closing_a_plain_stream_frees_its_slot_within_a_second(stack: Stack) -> None:
    """Stop means stop for an SDK client; a client that asked for event ids may still leave and resume."""
    key = create_key(stack, "--tenant", "stopper")
    client = openai.AsyncOpenAI(base_url=stack.edges[0].url + "/v1", api_key=key["key"], max_retries=0)
    stream = await client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=2000, stream=True)
    async for _chunk in stream:
        break
    assert await running_jobs(stack) == 1
    await stream.close()
    assert await until("the job aborted", lambda: _none_running(stack), 1.0) < 1.0
    await client.close()
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", stack.edges[0].url + "/v1/chat/completions",
                                json=chat_body(stack.model, 300), headers=bearer(key), limit=3)
        await asyncio.sleep(1.0)
        assert await running_jobs(stack) == 1  # kept for its resume window
        tail = await sse_frames(http, "POST", stack.edges[1].url + "/v1/chat/completions",
                                json=chat_body(stack.model, 300), headers={**bearer(key), "Last-Event-ID": head[-1][0]})
    assert tail[-1][1] == "[DONE]" and int(tail[0][0].rsplit(":", 1)[1]) == int(head[-1][0].rsplit(":", 1)[1]) + 1
    await stack.settled()


async def _none_running(stack: Stack) -> bool:
    return await running_jobs(stack) == 0


async def test_a_resumable_job_holds_its_lease_and_a_resume_spends_a_request(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "resumer", "--max-concurrency", "1", "--rpm", "100")
    url = stack.edges[0].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", url, json=chat_body(stack.model, 200), headers=bearer(key), limit=2)
        second = await http.post(url, json={**chat_body(stack.model, 5), "stream": False}, headers=bearer(key))
        assert second.status_code == 429 and second.json()["error"]["type"] == "concurrency"
        stream_id = head[-1][0].rsplit(":", 1)[0]
        async with http.stream("GET", f"{stack.edges[1].url}/v1/streams/{stream_id}",
                               headers={**bearer(key), "Last-Event-ID": head[-1][0]}) as resumed:
            assert resumed.status_code == 200
            remaining = int(resumed.headers.get("x-ratelimit-remaining-requests", "-1"))
            await resumed.aread()
        assert await until("the lease given back", lambda: _admitted(http, url, key), 5.0) < 5.0
    assert remaining in (97, 96)  # the first request, the refused one and the resume each spent one


async def _admitted(http: httpx.AsyncClient, url: str, key: dict[str, Any]) -> bool:
    answer = await http.post(url, json={**chat_body("fault-model", 2), "stream": False}, headers=bearer(key))
    return answer.status_code == 200


async def test_a_revoked_keys_streams_end_at_once(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "revoked")
    url = stack.edges[0].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        streaming = asyncio.create_task(sse_frames(http, "POST", url, json=chat_body(stack.model, 2000),
                                                   headers=bearer(key)))
        await until("the job running", lambda: _some_running(stack), 5.0)
        assert tokenbus(stack, "keys", "revoke", key["id"]).returncode == 0
        revoked_at = time.monotonic()  # the command's own start (a process) is not the edges' part
        frames = await asyncio.wait_for(streaming, 5)
    assert time.monotonic() - revoked_at < 2.0
    assert any("revoked" in data for _id, data in frames[-2:])
    await stack.settled()


async def test_a_revoked_keys_background_responses_stop_too(stack: Stack) -> None:
    """A background response runs on whatever its edge sees, but not past its key's revoke: its job stops."""
    key = create_key(stack, "--tenant", "revoked-background")
    async with httpx.AsyncClient(timeout=30) as http:
        created = await http.post(stack.edges[0].url + "/v1/responses", headers=bearer(key), json={
            "model": stack.model, "input": "count", "max_output_tokens": 3000, "background": True})  # 30 s of it
        assert created.status_code == 200, created.text
        await until("the job running", lambda: _some_running(stack), 5.0)
        assert tokenbus(stack, "keys", "revoke", key["id"]).returncode == 0
        await until("the job stopped", lambda: _none_running(stack), 5.0)
    await stack.settled()


async def test_a_key_that_expires_ends_its_streams_and_background_responses_as_a_revoke_does(stack: Stack) -> None:
    """Nothing announces an expiry: each edge that admitted the key ends its work when it expires, or a stream and
    a background response begun a second before run on (and are charged) up to the request timeout."""
    key = create_key(stack, "--tenant", "expiring", "--expires", "4s")
    expires_at = key["expires_at"]
    async with httpx.AsyncClient(timeout=30) as http:
        streaming = asyncio.create_task(sse_frames(http, "POST", stack.edges[0].url + "/v1/chat/completions",
                                                   json=chat_body(stack.model, 3000), headers=bearer(key)))
        created = await http.post(stack.edges[1].url + "/v1/responses", headers=bearer(key), json={
            "model": stack.model, "input": "count", "max_output_tokens": 3000, "background": True})  # 30 s of it
        assert created.status_code == 200, created.text
        frames = await asyncio.wait_for(streaming, 10)
        assert time.time() - expires_at < 2.0
        assert any("expired" in data for _id, data in frames[-2:])
        await until("the jobs stopped", lambda: _none_running(stack), 5.0)
        assert time.time() - expires_at < 4.0
    await stack.settled()


async def test_a_key_whose_expiry_is_brought_forward_ends_its_work_at_the_new_one(stack: Stack) -> None:
    """The edge admitted the key with an expiry an hour away; the operator brings it to seconds from now."""
    key = create_key(stack, "--tenant", "shortened", "--expires", "1h")
    async with httpx.AsyncClient(timeout=30) as http:
        streaming = asyncio.create_task(sse_frames(http, "POST", stack.edges[0].url + "/v1/chat/completions",
                                                   json=chat_body(stack.model, 3000), headers=bearer(key)))
        await until("the job running", lambda: _some_running(stack), 5.0)
        updated = tokenbus(stack, "keys", "--json", "update", key["id"], "--expires", "3s")
        assert updated.returncode == 0, updated.stderr
        expires_at = json.loads(updated.stdout)["expires_at"]
        frames = await asyncio.wait_for(streaming, 10)
    assert time.time() - expires_at < 2.0
    assert any("expired" in data for _id, data in frames[-2:])
    await stack.settled()


async def test_a_revoked_keys_resumed_stream_ends_too(stack: Stack) -> None:
    """A stream resumed on another edge is its key's as the first was: a revoke ends it, and its job."""
    key = create_key(stack, "--tenant", "revoked-resume")
    url = stack.edges[0].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", url, json=chat_body(stack.model, 3000), headers=bearer(key), limit=3)
        resumed = asyncio.create_task(sse_frames(
            http, "POST", stack.edges[1].url + "/v1/chat/completions", json=chat_body(stack.model, 3000),
            headers={**bearer(key), "Last-Event-ID": head[-1][0]}))

        await until("the stream resumed", lambda: _serving(http, stack.edges[1].metrics_url), 5.0)
        assert tokenbus(stack, "keys", "revoke", key["id"]).returncode == 0
        revoked_at = time.monotonic()
        frames = await asyncio.wait_for(resumed, 5)
    assert time.monotonic() - revoked_at < 2.0
    assert any("revoked" in data for _id, data in frames[-2:])
    await stack.settled()


async def test_a_stream_resumed_with_another_key_of_its_tenant_ends_when_that_key_is_revoked(stack: Stack) -> None:
    """A stream resumed with another key of its tenant is read with that key: revoking it ends the reading (the
    job runs on, as when a client leaves, and the key that began it resumes it to its end)."""
    owner = create_key(stack, "--tenant", "two-keys")
    reader = create_key(stack, "--tenant", "two-keys")
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", stack.edges[0].url + "/v1/chat/completions",
                                json=chat_body(stack.model, 600), headers=bearer(owner), limit=3)  # 6 s of tokens
        stream_url = f"/v1/streams/{head[-1][0].rsplit(':', 1)[0]}"
        resumed = asyncio.create_task(sse_frames(http, "GET", stack.edges[1].url + stream_url,
                                                 headers={**bearer(reader), "Last-Event-ID": head[-1][0]}))

        await until("the stream resumed", lambda: _serving(http, stack.edges[1].metrics_url), 5.0)
        assert tokenbus(stack, "keys", "revoke", reader["id"]).returncode == 0
        read = await asyncio.wait_for(resumed, 5)
        assert any("revoked" in data for _id, data in read[-2:])
        last_read = next(event_id for event_id, data in reversed(read) if event_id and "revoked" not in data)
        rest = await sse_frames(http, "GET", stack.edges[0].url + stream_url,
                                headers={**bearer(owner), "Last-Event-ID": last_read})
    assert rest[-1][1] == "[DONE]"
    await stack.settled()


async def _serving(http: httpx.AsyncClient, metrics_url: str) -> bool:
    """Whether an edge (its metrics) has a request in flight."""
    return metric_value((await http.get(metrics_url)).text, "tokenbus_edge_requests_in_flight") >= 1


async def _some_running(stack: Stack) -> bool:
    return await running_jobs(stack) > 0


async def test_a_keyless_edge_refuses_what_a_web_page_could_send(stack: Stack) -> None:
    edge = stack.edge(auth="none")
    body = orjson.dumps({"model": stack.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    async with httpx.AsyncClient(timeout=30) as http:
        form = await http.post(edge.url + "/v1/chat/completions", content=body,
                               headers={"content-type": "text/plain"})
        rebound = await http.post(edge.url + "/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json", "host": "evil.example:80"})
        local = await http.post(edge.url + "/v1/chat/completions", content=body,
                                headers={"content-type": "application/json", "host": "localhost"})
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    assert local.status_code == 200


async def test_usage_beyond_a_reservation_is_charged_after_the_limiters_state_expired(stack: Stack) -> None:
    redis = aioredis.Redis.from_url(stack.url)
    try:
        record = apikeys.KeyRecord(id="settle-test", hash="h", tenant="t", created_at=0, tpm=600)
        limits = Limits(redis, lease_ttl_s=3)
        job_charge = await limits.check(record, 10, "")
        assert not job_charge.refused
        await redis.delete(keys.rate_tokens(record.id))  # the job ran past its reservation's minute
        job = bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, tenant="t",
                      charge=bus.Charge(key=record.id, tokens=10, tpm=600))
        assert await Settlements(redis).settle(job, 100, 200)
        state = await limits.check(record, 0, "", consume=False)
        assert state.tokens_remaining <= 600 - 290  # the 290 tokens beyond the reservation count from now
    finally:
        await redis.aclose()


async def test_a_request_that_leaves_while_queued_gives_its_tokens_back(tmp_path: Path) -> None:
    """A client that leaves while its request waits for a worker (or that the queue timeout ends) takes its job off
    the backlog; the tokens reserved for it come back to its key: another tenant's full worker cannot make a
    tenant's waiting requests spend its quota."""
    with Stack(tmp_path) as small:
        worker = small.worker(max_num_seqs=1, sim_itl_ms=20)
        edge = small.edge(auth="keys")
        hog, patient = create_key(small, "--tenant", "hog"), create_key(
            small, "--tenant", "patient", "--quota-tokens", "300", "--quota-period", "day")
        url = edge.url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as http:
            holding = asyncio.create_task(sse_frames(http, "POST", url, json=chat_body(small.model, 1000),
                                                     headers=bearer(hog)))

            async def worker_has(metric: str, count: int) -> bool:
                text = (await http.get(worker.metrics_url)).text
                return metric_value(text, metric, {"model": small.model}) == count

            await until("the hog's job running", lambda: worker_has("tokenbus_worker_running_jobs", 1), 10)
            waiting = asyncio.create_task(http.post(url, json={**chat_body(small.model, 200), "stream": False},
                                                    headers=bearer(patient)))
            await until("the patient request queued", lambda: worker_has("tokenbus_queued_jobs", 1), 10)
            waiting.cancel()  # its client leaves
            await until("the patient request off the queue", lambda: worker_has("tokenbus_queued_jobs", 0), 10)
            holding.cancel()
            await small.settled()
            again = await http.post(url, json={**chat_body(small.model, 200), "stream": False}, headers=bearer(patient))
        assert again.status_code == 200, again.text  # without the tokens back: 429 insufficient_quota


async def test_bodies_of_millions_of_arrays_do_not_hold_up_the_edge(stack: Stack) -> None:
    """Four bodies of 7.5 MB of empty arrays at once, in a field the edge refuses and in a tool's schema: each is
    refused, and meanwhile the edge answers another client at once (built into objects, they held its loop for
    seconds)."""
    key = create_key(stack, "--tenant", "arrays")
    user = [{"role": "user", "content": "hi"}]
    bodies = [orjson.dumps({"model": stack.model, "messages": user, "audio": ARRAYS}),
              orjson.dumps({"model": stack.model, "messages": user, "tools": [
                  {"type": "function", "function": {"name": "f", "parameters": {"x": ARRAYS}}}]})] * 2
    url = stack.edges[0].url
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=8)) as http:
        await http.get(url + "/v1/models", headers=bearer(key))
        sent = [asyncio.create_task(http.post(url + "/v1/chat/completions", content=body, headers={
            **bearer(key), "content-type": "application/json"})) for body in bodies]
        waits = []
        while not all(task.done() for task in sent):
            asked = time.monotonic()
            assert (await http.get(url + "/v1/models", headers=bearer(key))).status_code == 200
            waits.append(time.monotonic() - asked)
            await asyncio.sleep(0.02)
        answers = [task.result() for task in sent]
    assert all(answer.status_code == 400 and answer.json()["error"]["message"] for answer in answers)
    assert max(waits) < 1.0, f"another client waited {max(waits):.2f} s"


async def test_a_stream_has_a_bounded_number_of_readers_on_an_edge(stack: Stack) -> None:
    """A resume takes no lease of its own (it continues its stream's), so one key could open any number of them
    on one stream, each holding a connection and every event since it began: an edge serves four readers of a
    stream at once and refuses more (429 concurrency); one that closes makes room."""
    key = create_key(stack, "--tenant", "many-readers", "--max-concurrency", "1")
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=20)) as http:
        head = await sse_frames(http, "POST", stack.edges[0].url + "/v1/chat/completions",
                                json=chat_body(stack.model, 400), headers=bearer(key), limit=2)
        url = f"{stack.edges[1].url}/v1/streams/{head[-1][0].rsplit(':', 1)[0]}"
        opened = []
        for _ in range(6):
            opened.append(await http.send(http.build_request("GET", url, headers=bearer(key)), stream=True))
        statuses = [answer.status_code for answer in opened]
        refused = next(answer for answer in opened if answer.status_code == 429)
        assert (await refused.aread()) and refused.json()["error"]["type"] == "concurrency"
        await opened[0].aclose()
        deadline = time.monotonic() + 5  # once the edge has seen that reader leave (at its next write)
        while (again := await http.send(http.build_request("GET", url, headers=bearer(key)), stream=True)
               ).status_code == 429 and time.monotonic() < deadline:
            await again.aclose()
            await asyncio.sleep(0.1)
        for answer in [*opened[1:], again]:
            await answer.aclose()
    assert statuses == [200] * 4 + [429] * 2
    assert again.status_code == 200


async def test_a_revoked_keys_background_response_stops_though_no_edge_follows_it(tmp_path: Path) -> None:
    """The edge that took a background response died: the response runs on (its log is its record), followed by
    no edge, and a revoke of its key still stops it."""
    with Stack(tmp_path) as small:
        worker = small.worker(sim_itl_ms=10, max_model_len=4096)
        taker = small.edge(auth="keys")
        key = create_key(small, "--tenant", "orphaned-background")
        async with httpx.AsyncClient(timeout=30) as http:
            created = await http.post(taker.url + "/v1/responses", headers=bearer(key), json={
                "model": small.model, "input": "count", "max_output_tokens": 3000, "background": True})  # 30 s
            assert created.status_code == 200, created.text

            async def running(count: int) -> bool:
                text = (await http.get(worker.metrics_url)).text
                return metric_value(text, "tokenbus_worker_running_jobs") == count

            await until("the job running", lambda: running(1), 5.0)
            small.kill(taker.process)
            small.edge(auth="keys")  # another edge, which hears of the revoke
            await asyncio.sleep(2)
            assert await running(1)  # it runs on without its edge
            assert tokenbus(small, "keys", "revoke", key["id"]).returncode == 0
            await until("the job stopped", lambda: running(0), 5.0)


def rss_mb(pid: int) -> float:
    """The process's resident memory now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _unread_download(port: int, path: str, key: str) -> socket.socket:
    """A client that asks for a file and reads none of it (a 4 kB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
    await asyncio.get_running_loop().sock_sendall(sock, request.encode())
    return sock


async def test_a_tenant_s_downloads_uploads_and_lists_take_a_bounded_part_of_an_edge(stack: Stack) -> None:
    """Files spend no rpm, so they are bounded otherwise: a download is sent a chunk at a time (12 clients that
    read nothing of a 7 MB file held 16 MB each on the edge), a tenant has at most 8 such calls in flight on an
    edge (more are 429 concurrency, and another tenant is served meanwhile), and a list sends a page of at most
    100 (it read and sent all 10,000 a tenant may hold, 0.13 s of the loop each)."""
    hoarder, other = create_key(stack, "--tenant", "hoarder")["key"], create_key(stack, "--tenant", "bystander")["key"]
    edge = stack.edges[0]
    port = int(edge.url.rsplit(":", 1)[1])
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=hoarder, max_retries=0, timeout=60) as client:
        big = await client.files.create(file=("big.bin", os.urandom(7 << 20)), purpose="user_data")
        before = rss_mb(edge.process.pid)
        held = [await _unread_download(port, f"/v1/files/{big.id}/content", hoarder) for _ in range(12)]
        try:
            await asyncio.sleep(2)
            grown = rss_mb(edge.process.pid) - before
            with pytest.raises(openai.RateLimitError) as refused:
                await client.files.list()
            assert refused.value.body["type"] == "concurrency"
            async with httpx.AsyncClient(timeout=10) as http:
                asked = time.monotonic()
                assert (await http.get(edge.url + "/v1/files", headers=bearer({"key": other}))).status_code == 200
                assert time.monotonic() - asked < 1.0
        finally:
            for sock in held:
                sock.close()
        assert grown < 40, f"12 unread downloads of a 7 MB file grew the edge by {grown:.0f} MB"
        deadline = time.monotonic() + 10  # the edge sees the closed sockets at its next write
        while True:
            try:
                assert (await client.files.content(big.id)).content[:16]
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the closed downloads still hold their calls"
                await asyncio.sleep(0.2)
        gate = asyncio.Semaphore(4)

        async def upload(n: int) -> str:
            async with gate:
                return (await client.files.create(file=(f"{n}.txt", b"x"), purpose="user_data")).id
        small = await asyncio.gather(*(upload(n) for n in range(120)))
        page = await client.files.list(extra_query={"limit": 10000})
        assert len(page.data) == 100 and page.has_more
        listed = [f.id async for f in client.files.list(order="asc")]  # the SDK pages on
        assert sorted(listed) == sorted([big.id, *small]) and listed[0] == big.id
        assert [f.id for f in (await client.files.list(order="asc", after=listed[9], limit=3)).data] == listed[10:13]
        with pytest.raises(openai.NotFoundError):
            await client.files.content(big.id + ":chunks")


async def test_a_client_that_reads_nothing_of_an_answer_is_dropped_after_the_write_stall(stack: Stack) -> None:
    """An answer the edge writes whole (a file, a model's answer not streamed, a large page of a list) has a
    deadline on each write: eight answers left unread (four downloads, four 7 MB pages of a conversation's items)
    hold all of their tenant's calls only until --write-stall-s (1 s here) drops them, though their clients keep
    their connections open."""
    key = create_key(stack, "--tenant", "stalled")["key"]
    edge = stack.edge(auth="keys", lease_ttl_s=3, write_stall_s=1)
    port = int(edge.url.rsplit(":", 1)[1])
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=key, max_retries=0, timeout=60) as client:
        big = await client.files.create(file=("big.bin", os.urandom(7 << 20)), purpose="user_data")
        items = [{"type": "message", "role": "user", "content": "x" * 70_000} for _ in range(20)]
        talk = await client.conversations.create(items=items)
        for _ in range(4):
            await client.conversations.items.create(talk.id, items=items)
        held = [await _unread_download(port, f"/v1/files/{big.id}/content", key) for _ in range(4)]
        held += [await _unread_download(port, f"/v1/conversations/{talk.id}/items?limit=100", key) for _ in range(4)]
        try:
            await asyncio.sleep(0.3)
            with pytest.raises(openai.RateLimitError):
                await client.files.retrieve(big.id)
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert (await client.files.retrieve(big.id)).id == big.id
                    break
                except openai.RateLimitError:
                    assert time.monotonic() < deadline, "the unread downloads still hold their calls"
                    await asyncio.sleep(0.2)
            assert time.monotonic() - deadline + 10 < 5
        finally:
            for sock in held:
                sock.close()


async def test_a_download_cut_short_closes_its_connection_never_hangs_it(stack: Stack) -> None:
    """A file deleted while it downloads: the client gets its first chunks, then the connection closes (it had
    waited for bytes that would never come, and the next answer on that connection went into the file's)."""
    key = create_key(stack, "--tenant", "cut-short")["key"]
    edge = stack.edges[0]
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=key, max_retries=0, timeout=60) as client:
        big = await client.files.create(file=("big.bin", os.urandom(7 << 20)), purpose="user_data")
        sock = await _unread_download(int(edge.url.rsplit(":", 1)[1]), f"/v1/files/{big.id}/content", key)
        try:
            await asyncio.sleep(0.5)  # the edge waits on its first chunk's write
            await client.files.delete(big.id)
            received, loop = b"", asyncio.get_running_loop()
            async with asyncio.timeout(15):
                while chunk := await loop.sock_recv(sock, 1 << 16):
                    received += chunk
        finally:
            sock.close()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and f"Content-Length: {7 << 20}".encode() in head
    assert 0 < len(body) < 7 << 20  # cut short, and closed: the read above ended


def _form(parts: list[tuple[bytes, bytes]], boundary: bytes = b"tb-form") -> bytes:
    """A multipart/form-data body of (Content-Disposition, bytes) parts."""
    body = b"".join(b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\n\r\n" + data + b"\r\n"
                    for disposition, data in parts)
    return body + b"--" + boundary + b"--\r\n"


async def test_an_upload_s_form_is_read_part_by_part_within_bounds(stack: Stack) -> None:
    """aiohttp's own form reading takes 1,000 parts and parses each Content-Disposition three times, at about half
    a microsecond a character of escapes: one 8 MB upload of 500 parts with 16 KB file names of backslashes held
    the edge's loop 23 s. Now a form has at most 8 parts, each disposition at most 1 KiB; another client is
    answered meanwhile, and a part's header over aiohttp's line limit is a 400 (it was a 500 and a logged trace)."""
    key = create_key(stack, "--tenant", "forms")
    purpose = (b'form-data; name="purpose"', b"user_data")
    escapes = [(b'form-data; name="f"; filename="' + b"\\a" * 8150 + b'"', b"x")] * 500
    forms = {
        "escapes": _form([purpose, *escapes]),
        "parts": _form([purpose, *[(b'form-data; name="f"; filename="a"', b"x")] * 900,
                        (b'form-data; name="file"; filename="a.txt"', b"hi")]),
        "line": _form([purpose, (b'form-data; name="file"; filename="' + b"a" * 20_000 + b'"', b"x")]),
    }
    url = stack.edges[0].url
    headers = {**bearer(key), "content-type": "multipart/form-data; boundary=tb-form"}
    async with httpx.AsyncClient(timeout=60) as http:
        await http.get(url + "/health")
        sent = {name: asyncio.create_task(http.post(url + "/v1/files", content=body, headers=headers))
                for name, body in forms.items()}
        waits = []
        while not all(task.done() for task in sent.values()):
            asked = time.monotonic()
            assert (await http.get(url + "/health")).status_code == 200
            waits.append(time.monotonic() - asked)
            await asyncio.sleep(0.02)
        answers = {name: task.result() for name, task in sent.items()}
        kept = await http.post(url + "/v1/files", headers=bearer(key), data={"purpose": "user_data"},
                               files={"file": ("ok.txt", b"hello")})
    assert max(waits) < 0.5, f"another client waited {max(waits):.2f} s"
    assert {name: answer.status_code for name, answer in answers.items()} == dict.fromkeys(forms, 400)
    assert all(answer.json()["error"]["param"] == "file" for answer in answers.values()), answers
    assert kept.status_code == 200 and kept.json()["bytes"] == 5, kept.text
