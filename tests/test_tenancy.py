"""Tenants and keys, against real processes: three `tokenbus edge --auth keys` on one Redis and a simulated
worker. Keys are made with the `tokenbus keys` command, as an operator would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from huggingface_hub import InferenceClient
from huggingface_hub.errors import OverloadedError

from shared.protocol import keys
from tests.processes import ROOT, metric_value
from tests.stack import Stack

LEASE_TTL_S = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("tenancy")) as running:
        running.worker(sim_ttft_ms=1, sim_itl_ms=5, max_num_seqs=256, max_model_len=4096)
        for _ in range(3):
            running.edge(auth="keys", lease_ttl_s=LEASE_TTL_S, resume_window_s=0)
        yield running


def tokenbus(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=stack.admin_env())


def create_key(stack: Stack, *options: str) -> dict[str, Any]:
    made = tokenbus(stack, "keys", "--json", "create", *options)
    assert made.returncode == 0, made.stderr
    found: dict[str, Any] = json.loads(made.stdout)
    return found


def bearer(key: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key['key']}"}


def chat(model: str, tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "count"}], "max_tokens": tokens, **extra}


async def post_all(urls: list[str], body: dict[str, Any], headers: dict[str, str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
        return await asyncio.gather(*(http.post(url + "/v1/chat/completions", json=body, headers=headers)
                                      for url in urls))


# keys


def test_the_keys_command_creates_shows_updates_and_revokes(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "cli", "--rpm", "5", "--models", "a,b", "--expires", "30d")
    assert key["key"].startswith("tb-") and key["tenant"] == "cli" and key["rpm"] == 5
    listed = tokenbus(stack, "keys", "--json", "list").stdout
    assert key["id"] in listed and key["key"] not in listed  # only the hash is stored
    assert key["key"] not in stack.client.hget("tokenbus:apikeys", key["id"]).decode()
    updated = json.loads(tokenbus(stack, "keys", "--json", "update", key["id"], "--rpm", "7").stdout)
    assert updated["rpm"] == 7 and updated["models"] == ["a", "b"]
    assert json.loads(tokenbus(stack, "keys", "--json", "show", key["id"]).stdout)["rpm"] == 7
    refused = tokenbus(stack, "keys", "create", "--tenant", "x", "--priority", "12")
    assert refused.returncode == 2 and "priority" in refused.stderr
    assert json.loads(tokenbus(stack, "keys", "--json", "revoke", key["id"]).stdout)["revoked"] is True
    assert tokenbus(stack, "keys", "show", key["id"]).returncode == 1


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", "chat"), ("/v3/chat/completions", "chat"), ("/generate", "tgi"),
    ("/serving-endpoints/{model}/invocations", "chat"), ("/v1/models", None)])
async def test_a_missing_or_unknown_key_is_a_401_in_the_route_shape(stack: Stack, path: str, body: str | None) -> None:
    url = stack.edges[0].url + path.format(model=stack.model)
    payload = {"chat": chat(stack.model), "tgi": {"inputs": "count", "parameters": {"max_new_tokens": 2}}}
    async with httpx.AsyncClient(timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer tb-nope"}, {"api-key": "tb-nope"}):
            if body is None:
                answer = await http.get(url, headers=headers)
            else:
                answer = await http.post(url, json=payload[body], headers=headers)
            assert answer.status_code == 401, answer.text
            error = answer.json()["error"]
            if path == "/generate":
                assert answer.json()["error_type"] and isinstance(error, str)
            else:
                assert error["code"] == "invalid_api_key"


async def test_a_tgi_client_over_its_limit_is_told_overloaded_which_it_retries(stack: Stack) -> None:
    """TGI has one kind of 429, `overloaded`: huggingface_hub raises OverloadedError for it (and retries on it
    where asked), where any other error_type is an unknown error."""
    key = create_key(stack, "--tenant", "tgi-limited", "--rpm", "1")
    client = InferenceClient(model=stack.edges[0].url, token=key["key"], timeout=10)
    await asyncio.to_thread(client.text_generation, "count", max_new_tokens=2)
    with pytest.raises(OverloadedError):
        await asyncio.to_thread(client.text_generation, "count", max_new_tokens=2)


async def test_every_key_header_the_clients_send_is_accepted(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "headers")
    async with httpx.AsyncClient(timeout=10) as http:
        for headers in (bearer(key), {"api-key": key["key"]}, {"x-api-key": key["key"]}):
            answer = await http.post(stack.edges[1].url + "/v1/chat/completions", json=chat(stack.model),
                                     headers=headers)
            assert answer.status_code == 200, answer.text


async def test_a_model_the_key_may_not_use_does_not_exist_for_it(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "narrow", "--models", "some-other-model")
    async with openai.AsyncOpenAI(base_url=stack.edges[0].url + "/v1", api_key=key["key"], max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}])
        assert [m.id async for m in client.models.list()] == []
        with pytest.raises(openai.NotFoundError) as unseen:
            await client.models.retrieve(stack.model)
    assert refused.value.code == "model_not_found"
    assert unseen.value.code == "model_not_found"


async def test_a_model_the_key_may_use_is_retrieved_as_the_list_shows_it(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "retriever")
    async with openai.AsyncOpenAI(base_url=stack.edges[0].url + "/v1", api_key=key["key"], max_retries=0) as client:
        listed = {m.id: m async for m in client.models.list()}
        found = await client.models.retrieve(stack.model)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such/model")
    assert found == listed[stack.model] and found.object == "model"


async def test_a_revoked_key_is_refused_by_every_edge_within_a_second(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "revoked")
    urls = [e.url for e in stack.edges]
    assert all(a.status_code == 200 for a in await post_all(urls, chat(stack.model), bearer(key)))  # now cached
    assert tokenbus(stack, "keys", "revoke", key["id"]).returncode == 0
    await asyncio.sleep(1)
    assert [a.status_code for a in await post_all(urls, chat(stack.model), bearer(key))] == [401, 401, 401]


# limits


async def test_rpm_is_exact_across_three_edges(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "rpm", "--rpm", "10")
    answers = await post_all([e.url for e in stack.edges for _ in range(50)], chat(stack.model), bearer(key))
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 10 and statuses.count(429) == 140
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["Retry-After"]) <= 7  # one request comes back every 6 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-limit-requests"] == "10"
    async with httpx.AsyncClient() as http:
        texts = [(await http.get(e.metrics_url)).text for e in stack.edges]
    counted = {outcome: sum(metric_value(text, "tokenbus_edge_tenant_requests_total",
                                         {"tenant": "rpm", "outcome": outcome}) for text in texts)
               for outcome in ("admitted", "requests")}
    assert counted == {"admitted": 10, "requests": 140}


async def test_tokens_admitted_never_exceed_tpm_and_unused_tokens_come_back(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "tpm", "--tpm", "1000")
    started = time.monotonic()
    answers = await post_all([stack.edges[i % 3].url for i in range(30)], chat(stack.model, tokens=95), bearer(key))
    elapsed = time.monotonic() - started
    admitted = [a for a in answers if a.status_code == 200]
    reserved_each = 95 + 2 + 4  # "count": 2 estimated prompt tokens, 4 for the message
    assert len(admitted) * reserved_each <= 1000 * (1 + elapsed / 60)
    assert len(admitted) == 1000 // reserved_each
    assert {a.json()["error"]["type"] for a in answers if a.status_code == 429} == {"tokens"}
    # a stream cut after its first tokens is aborted (no resume window) and its unused budget refunded
    key = create_key(stack, "--tenant", "refund", "--tpm", "600")
    url = stack.edges[0].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", url, json=chat(stack.model, tokens=500, stream=True),
                               headers=bearer(key)) as cut:
            assert cut.status_code == 200
            async for line in cut.aiter_lines():
                if line.startswith("data:"):
                    break
        for _ in range(50):  # the worker settles right after the abort
            again = await http.post(url, json=chat(stack.model, tokens=500), headers=bearer(key))
            if again.status_code == 200:
                break
            await asyncio.sleep(0.1)
    assert again.status_code == 200, again.text


async def test_a_concurrency_refusal_still_spends_its_request(stack: Stack) -> None:
    """As at OpenAI, a refused request counts against the rpm: resending it at once cannot hammer the edge."""
    key = create_key(stack, "--tenant", "concurrent", "--max-concurrency", "2", "--rpm", "10")
    url = stack.edges[0].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        long = [asyncio.create_task(http.post(url, json=chat(stack.model, tokens=300), headers=bearer(key)))
                for _ in range(2)]
        await asyncio.sleep(0.5)
        refused = [await http.post(url, json=chat(stack.model), headers=bearer(key)) for _ in range(3)]
        assert [answer.status_code for answer in await asyncio.gather(*long)] == [200, 200]
        after = await http.post(url, json=chat(stack.model), headers=bearer(key))
    assert [r.status_code for r in refused] == [429, 429, 429]
    assert refused[0].json()["error"]["type"] == "concurrency"
    assert refused[-1].headers["x-ratelimit-remaining-requests"] == "5"  # two served, three refused
    assert after.status_code == 200 and after.headers["x-ratelimit-remaining-requests"] == "4"


async def test_leases_of_a_killed_edge_are_freed_within_the_lease_ttl(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "leases", "--max-concurrency", "2")
    doomed = stack.edge(auth="keys", lease_ttl_s=LEASE_TTL_S, resume_window_s=0)
    survivor = stack.edges[0].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        held = [asyncio.create_task(http.post(doomed.url + "/v1/chat/completions", json=chat(stack.model, tokens=2000),
                                              headers=bearer(key))) for _ in range(2)]
        admitted_by = time.monotonic() + 10
        while stack.client.zcard(keys.leases(key["id"])) < 2:  # both admitted, however busy the machine is
            assert time.monotonic() < admitted_by, "the two streams were never admitted"
            await asyncio.sleep(0.05)
        assert (await http.post(survivor, json=chat(stack.model), headers=bearer(key))).status_code == 429
        stack.kill(doomed.process)
        stack.edges.remove(doomed)
        killed_at = time.monotonic()
        await asyncio.gather(*held, return_exceptions=True)
        while (await http.post(survivor, json=chat(stack.model), headers=bearer(key))).status_code == 429:
            assert time.monotonic() - killed_at < LEASE_TTL_S + 1.5
            await asyncio.sleep(0.1)


async def test_a_spent_quota_is_insufficient_quota(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "quota", "--quota-tokens", "250", "--quota-period", "day")
    url = stack.edges[2].url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        first = await http.post(url, json=chat(stack.model, tokens=200), headers=bearer(key))
        second = await http.post(url, json=chat(stack.model, tokens=200), headers=bearer(key))
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "insufficient_quota"
    assert int(second.headers["Retry-After"]) <= 24 * 3600


async def test_rate_limit_headers_are_on_every_answer_of_every_family(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "headers-everywhere", "--rpm", "7", "--tpm", "100000")
    base = stack.edges[0].url
    calls = [
        ("POST", "/v1/chat/completions", chat(stack.model)),
        ("POST", "/v1/chat/completions", chat(stack.model, stream=True)),
        ("POST", "/v3/completions", {"model": stack.model, "prompt": "count", "max_tokens": 2, "stream": True}),
        ("POST", f"/serving-endpoints/{stack.model}/invocations", {"messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/generate", {"inputs": "count", "parameters": {"max_new_tokens": 2}}),
        ("POST", "/generate_stream", {"inputs": "count", "parameters": {"max_new_tokens": 2}}),
        ("GET", "/v1/models", None),
    ]
    remaining = []
    async with httpx.AsyncClient(timeout=30) as http:
        for method, path, body in calls:
            async with http.stream(method, base + path, json=body, headers=bearer(key)) as answer:
                assert answer.status_code == 200, (path, await answer.aread())
                assert answer.headers["x-ratelimit-limit-requests"] == "7", path
                assert answer.headers["x-ratelimit-limit-tokens"] == "100000", path
                assert answer.headers["x-ratelimit-reset-tokens"].endswith("s"), path
                remaining.append(int(answer.headers["x-ratelimit-remaining-requests"]))
                await answer.aread()
    assert remaining == [6, 5, 4, 3, 2, 1, 1]  # one request comes back every 8.6 s; listing models spends none


# isolation and accounting


async def test_a_tenant_cannot_touch_another_tenants_work(stack: Stack) -> None:
    owner, other = create_key(stack, "--tenant", "owner"), create_key(stack, "--tenant", "other")
    base = stack.edges[0].url
    async with httpx.AsyncClient(timeout=30) as http:
        stored = (await http.post(base + "/v1/responses", json={"model": stack.model, "input": "hi",
                                                                 "max_output_tokens": 3}, headers=bearer(owner))).json()
        rid = stored["id"]
        assert (await http.get(f"{base}/v1/responses/{rid}", headers=bearer(other))).status_code == 404
        assert (await http.delete(f"{base}/v1/responses/{rid}", headers=bearer(other))).status_code == 404
        continued = await http.post(base + "/v1/responses", json={"model": stack.model, "input": "more",
                                                                   "previous_response_id": rid}, headers=bearer(other))
        assert continued.status_code == 400 and continued.json()["error"]["code"] == "previous_response_not_found"
        assert (await http.get(f"{base}/v1/responses/{rid}", headers=bearer(owner))).status_code == 200
        async with http.stream("POST", base + "/v1/chat/completions", json=chat(stack.model, tokens=5, stream=True),
                               headers={**bearer(owner), "Accept": "text/event-stream"}) as streamed:
            lines = [line async for line in streamed.aiter_lines()]
        first_id = next(line[4:] for line in lines if line.startswith("id:"))
        stream_id = first_id.rpartition(":")[0]
        theirs = await http.get(f"{stack.edges[1].url}/v1/streams/{stream_id}", headers=bearer(other))
        mine = await http.get(f"{stack.edges[1].url}/v1/streams/{stream_id}", headers=bearer(owner))
    assert theirs.status_code == 404
    assert mine.status_code == 200 and "[DONE]" in mine.text


async def test_usage_is_accounted_per_tenant_and_model(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "accounted")
    async with openai.AsyncOpenAI(base_url=stack.edges[1].url + "/v1", api_key=key["key"], max_retries=0) as client:
        answers = [await client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "one two three"}], max_tokens=n)
            for n in (3, 4)]
    expected = {"requests": 2, "prompt": sum(a.usage.prompt_tokens for a in answers if a.usage),
                "completion": sum(a.usage.completion_tokens for a in answers if a.usage)}
    deadline = time.monotonic() + 5
    while True:
        rows = json.loads(tokenbus(stack, "usage", "--json", "--tenant", "accounted").stdout or "[]")
        if (rows and rows[0]["requests"] == 2) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert rows == [{"tenant": "accounted", "model": stack.model, **expected, "batch_requests": 0, "batch_prompt": 0,
                     "batch_completion": 0, "total_tokens": expected["prompt"] + expected["completion"]}]
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(stack.workers[0].metrics_url)).text
    assert metric_value(metrics, "tokenbus_worker_tenant_tokens_total",
                        {"tenant": "accounted", "kind": "completion"}) == expected["completion"]
    assert metric_value(metrics, "tokenbus_worker_queue_wait_seconds_count", {"tenant": "accounted"}) == 2


async def test_usage_is_accounted_when_redis_lost_its_scripts(stack: Stack) -> None:
    """Redis restarted without its scripts: the settle that rides in the worker's write of the job's last events
    finds none, and the worker settles on its own, which loads it; the usage is counted once."""
    key = create_key(stack, "--tenant", "unscripted")
    admin = redis.Redis.from_url(stack.url)
    try:
        admin.script_flush()
        async with openai.AsyncOpenAI(base_url=stack.edges[0].url + "/v1", api_key=key["key"],
                                      max_retries=0) as client:
            answer = await client.chat.completions.create(
                model=stack.model, messages=[{"role": "user", "content": "one two"}], max_tokens=3)
    finally:
        admin.close()
    assert answer.usage is not None
    deadline = time.monotonic() + 5
    while True:
        rows = json.loads(tokenbus(stack, "usage", "--json", "--tenant", "unscripted").stdout or "[]")
        if rows or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert [(r["requests"], r["completion"]) for r in rows] == [(1, answer.usage.completion_tokens)]


def test_make_run_serves_without_keys_and_says_so() -> None:
    from services.cli import parser

    args = parser().parse_args(["run"])
    assert args.auth is None  # `tokenbus run` then serves with --auth none (see services.cli.main)
    edge_args = parser().parse_args(["edge"])
    from shared.runtime.settings import load

    assert load(edge_args, environ={}).auth == "keys"


async def test_without_redis_for_limits_the_policy_decides(tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    from services.edge.admission import Admitter
    from services.edge.auth import Caller
    from services.supervisor import free_port
    from shared.protocol import bus
    from shared.protocol.errors import RateLimited, Unavailable
    from shared.tenancy.apikeys import KeyRecord
    from shared.tenancy.limits import Limits, Settlements

    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}", socket_connect_timeout=0.5)
    caller = Caller("t", KeyRecord(id="k", hash="h", tenant="t", created_at=0, rpm=4))
    job = bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, messages=[bus.Message(role="user", content="x")])
    for policy in ("closed", "open", "local"):
        admitter = Admitter(Limits(dead, 5), Settlements(dead), policy, edges=lambda: 2)
        if policy == "closed":
            with pytest.raises(Unavailable):
                await admitter.take_request(caller)
            with pytest.raises(Unavailable):
                await admitter.admit(caller, job, 100)
            continue
        outcomes = []
        for _ in range(4):
            try:
                await admitter.take_request(caller)  # as the edge does: the request first, then the job
                await admitter.admit(caller, job, 100)
                outcomes.append("admitted")
            except RateLimited:
                outcomes.append("refused")
        # open admits everything; local enforces this edge's half of 4 per minute
        assert outcomes == (["admitted"] * 4 if policy == "open" else ["admitted"] * 2 + ["refused"] * 2)
    await dead.aclose()


# A background response's length: 8 s at the simulated 5 ms a token, so that a loaded machine's stall of a few
# seconds between two calls does not let it end before the test looks at the slot it holds.
LONG_ANSWER = 1600


async def _ends_then_frees_its_slot(client: openai.AsyncOpenAI, response_id: str, model: str) -> None:
    """Waits for a background response of LONG_ANSWER tokens to end (incomplete: its length), then for the key's
    one concurrency slot to come back (its follower gives it back once it has stored the answer)."""
    deadline = time.monotonic() + 40
    while (found := await client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert found.status == "incomplete" and found.usage is not None and found.usage.output_tokens == LONG_ANSWER
    while True:
        try:
            after = await client.responses.create(model=model, input="count", max_output_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    assert after.status == "incomplete"


async def test_a_background_response_holds_its_concurrency_until_it_ends_and_is_its_tenants_alone(
        stack: Stack) -> None:
    """Nobody waits on it (these edges keep nothing for a resume), yet it runs to its end holding its key's one
    concurrency slot; another tenant can neither read nor cancel it."""
    key = create_key(stack, "--tenant", "background", "--max-concurrency", "1")
    stranger = create_key(stack, "--tenant", "stranger")
    url = stack.edges[0].url + "/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key=key["key"], max_retries=0) as client, \
            openai.AsyncOpenAI(base_url=url, api_key=stranger["key"], max_retries=0) as other:
        created = await client.responses.create(model=stack.model, input="count", max_output_tokens=LONG_ANSWER,
                                                background=True)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.responses.create(model=stack.model, input="count", max_output_tokens=2)
        assert refused.value.body["type"] == "concurrency"
        for call in (other.responses.retrieve, other.responses.cancel):
            with pytest.raises(openai.NotFoundError):
                await call(created.id)
        await _ends_then_frees_its_slot(client, created.id, stack.model)


async def test_a_streamed_background_response_holds_its_concurrency_after_its_client_left(stack: Stack) -> None:
    """Its client reads two events and leaves: the response runs on to its end, still holding the key's one
    concurrency slot (the edge follows it from then on), and is stored once it ended."""
    key = create_key(stack, "--tenant", "streamer", "--max-concurrency", "1")
    url = stack.edges[0].url + "/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key=key["key"], max_retries=0) as client:
        stream = await client.responses.create(model=stack.model, input="count", max_output_tokens=LONG_ANSWER,
                                               background=True, stream=True)
        response_id = ""
        async for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.sequence_number >= 2:
                break
        await stream.close()
        with pytest.raises(openai.RateLimitError) as refused:
            await client.responses.create(model=stack.model, input="count", max_output_tokens=2)
        assert refused.value.body["type"] == "concurrency"
        await _ends_then_frees_its_slot(client, response_id, stack.model)


async def test_a_conversation_is_its_tenants_alone_and_counts_against_its_storage(stack: Stack) -> None:
    key = create_key(stack, "--tenant", "talker", "--storage-items", "1")
    stranger = create_key(stack, "--tenant", "eavesdropper")
    url = stack.edges[0].url + "/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key=key["key"], max_retries=0) as client, \
            openai.AsyncOpenAI(base_url=url, api_key=stranger["key"], max_retries=0) as other:
        conversation = await client.conversations.create(items=[{"role": "user", "content": "secret"}])
        for call in (other.conversations.retrieve(conversation.id), other.conversations.items.list(conversation.id),
                     other.conversations.delete(conversation.id),
                     other.responses.create(model=stack.model, input="x", conversation=conversation.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        with pytest.raises(openai.RateLimitError) as full:  # its one stored item is the conversation
            await client.conversations.create()
        assert "storage is full" in full.value.message
        await client.conversations.delete(conversation.id)
        assert (await client.conversations.create()).id.startswith("conv_")


async def test_a_file_is_its_tenants_alone(stack: Stack) -> None:
    key, stranger = create_key(stack, "--tenant", "filer"), create_key(stack, "--tenant", "snooper")
    url = stack.edges[0].url + "/v1"
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}})
    async with openai.AsyncOpenAI(base_url=url, api_key=key["key"], max_retries=0) as client, \
            openai.AsyncOpenAI(base_url=url, api_key=stranger["key"], max_retries=0) as other:
        uploaded = await client.files.create(file=("in.jsonl", line.encode()), purpose="batch")
        for call in (other.files.retrieve(uploaded.id), other.files.content(uploaded.id),
                     other.files.delete(uploaded.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        assert [f.id async for f in other.files.list()] == []
        assert (await client.files.content(uploaded.id)).content == line.encode()


async def test_a_batch_is_its_tenants_alone_bounded_in_number_and_its_usage_counted_apart(stack: Stack) -> None:
    key, stranger = create_key(stack, "--tenant", "batcher"), create_key(stack, "--tenant", "prowler")
    edge = stack.edge(auth="keys", lease_ttl_s=LEASE_TTL_S, batch_max_open=1)
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": chat(stack.model, tokens=40)}) + "\n" for i in range(120))
    try:
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=key["key"], max_retries=0) as client, \
                openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=stranger["key"], max_retries=0) as other:
            uploaded = await client.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
            batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            def file_reads() -> int:
                return int(stack.client.info("commandstats").get("cmdstat_lrange", {}).get("calls", 0))

            deadline = time.monotonic() + 30
            while (await client.batches.retrieve(batch.id)).status == "validating":  # its driver read its file
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            reads = file_reads()
            with pytest.raises(openai.RateLimitError):  # one open batch a tenant on this edge's setting
                await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
            assert file_reads() == reads  # refused before its input file (up to 8 MB) was read
            for call in (other.batches.retrieve(batch.id), other.batches.cancel(batch.id),
                         other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
                with pytest.raises(openai.NotFoundError):
                    await call
            assert [b.id async for b in other.batches.list()] == []
            deadline = time.monotonic() + 60
            while (done := await client.batches.retrieve(batch.id)).status != "completed":
                assert time.monotonic() < deadline and done.status in ("validating", "in_progress", "finalizing")
                await asyncio.sleep(0.2)
            assert done.request_counts is not None and done.request_counts.completed == 120
            assert done.usage is not None
        rows = json.loads(tokenbus(stack, "usage", "--json", "--tenant", "batcher").stdout or "[]")
        assert [(row["requests"], row["batch_requests"], row["batch_completion"]) for row in rows] == [
            (0, 120, done.usage.output_tokens)]
        assert rows[0]["batch_prompt"] == done.usage.input_tokens > 0
    finally:
        stack.edges.remove(edge)
        stack.kill(edge.process)


async def test_a_batch_is_an_item_of_its_tenants_storage(stack: Stack) -> None:
    """A batch's record counts as one stored item until it expires: a tenant whose storage holds two items has
    room for its batch file and one batch, not a second (a tenant cannot pile up batch records unbounded)."""
    key = create_key(stack, "--tenant", "hoarder", "--storage-items", "2")
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat(stack.model)})
    async with openai.AsyncOpenAI(base_url=stack.edges[0].url + "/v1", api_key=key["key"], max_retries=0) as client:
        uploaded = await client.files.create(file=("in.jsonl", line.encode()), purpose="batch")
        await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
        with pytest.raises(openai.RateLimitError) as refused:
            await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    assert refused.value.body["code"] == "storage_quota_exceeded"



async def test_a_revoked_keys_batch_stops_and_fails_with_invalid_key(stack: Stack) -> None:
    """A batch runs for its key as the key is now: once the key is revoked no more of its lines run (they were run
    and charged to the revoked key to the batch's end); what was answered before is kept in its files."""
    key = create_key(stack, "--tenant", "revoked-batcher")
    edge = stack.edges[0]
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": chat(stack.model, tokens=200)}) + "\n" for i in range(400))
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=key["key"], max_retries=0) as client:
        uploaded = await client.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        deadline = time.monotonic() + 30
        while not ((counts := (await client.batches.retrieve(batch.id)).request_counts) and counts.completed):
            assert time.monotonic() < deadline, counts
            await asyncio.sleep(0.05)
    assert tokenbus(stack, "keys", "revoke", key["id"]).returncode == 0
    deadline = time.monotonic() + 30
    stored = keys.batch(key["tenant"], batch.id)  # the key can no longer read it: Redis holds what it would see
    while (ended := json.loads(stack.client.hget(stored, "info") or b"{}")).get("status") not in (
            "failed", "completed"):
        assert time.monotonic() < deadline, ended
        await asyncio.sleep(0.2)
    assert ended["status"] == "failed" and ended["errors"]["data"][0]["code"] == "invalid_key", ended
    assert 0 < int(stack.client.hget(stored, "completed") or 0) < 400
