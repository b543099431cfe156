"""Anthropic's Messages API with real processes (an edge, a simulated worker, a real Redis) and the official
`anthropic` SDK: every streamed event and every body parsed by the SDK's own types, the SDK's stream accumulating
the same message as the unstreamed answer; keys in `x-api-key`, errors in Anthropic's shape (the SDK raises its own
exception for each), the key's limits and a resumed stream as on every other route. The real model's answers
(tools, thinking, exact token counts) are in tests/test_messages.py."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pydantic
import pytest
import redis.asyncio as aioredis
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent

from shared.tenancy import apikeys
from tests.processes import metric_value
from tests.stack import Stack

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
ASK = [{"role": "user", "content": "count"}]


def expected(tokens: int) -> str:
    return "".join(f" t{n}" for n in range(1, tokens + 1))


def blocks(message: Message) -> list[dict[str, Any]]:
    """A message's content as plain data (a streamed message's blocks are the SDK's Parsed* subclasses)."""
    return [block.model_dump(exclude={"parsed_output"}) for block in message.content]


async def raw_events(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[Any]:
    """A streamed Messages request's events but its pings, each parsed by the SDK's RawMessageStreamEvent
    (strictly, from the bytes sent), its SSE event name the same as its type."""
    events = []
    async with httpx.AsyncClient(timeout=30) as http, http.stream(
            "POST", url + "/v1/messages", json={**body, "stream": True}, headers=headers or {}) as response:
        assert response.status_code == 200, await response.aread()
        name = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name == "ping":  # the SDK skips pings: no type of its own
                assert json.loads(line.removeprefix("data: ")) == {"type": "ping"}
            elif line.startswith("data: "):
                event = EVENTS.validate_json(line.removeprefix("data: "), strict=True)
                assert event.type == name
                events.append(event)
    return events


async def test_an_answer_streamed_and_not_in_the_sdk_s_own_types(stack: Stack) -> None:
    edge = stack.edge()
    stack.worker()
    async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
        raw = await client.messages.with_raw_response.create(model=stack.model, max_tokens=5, messages=ASK,
                                                             system="Count.")
        message = Message.model_validate_json(raw.http_response.content, strict=True)
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == expected(5)
        assert (message.role, message.stop_reason, message.stop_sequence) == ("assistant", "max_tokens", None)
        assert message.id.startswith("msg_") and message.model == stack.model
        assert message.usage.output_tokens == 5 and message.usage.input_tokens > 0
        async with client.messages.stream(model=stack.model, max_tokens=5, messages=ASK, system="Count.") as stream:
            streamed = await stream.get_final_message()
        assert blocks(streamed) == blocks(message) and streamed.usage == message.usage
        assert streamed.stop_reason == "max_tokens"
    events = await raw_events(edge.url, {"model": stack.model, "max_tokens": 3, "messages": ASK})
    assert [event.type for event in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(event.delta.text for event in events if event.type == "content_block_delta") == expected(3)
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 3
    await stack.settled()


async def test_count_tokens_counts_what_the_worker_would_run(stack: Stack) -> None:
    """count_tokens counts the prompt the worker renders (the simulated engine: one token a word), as the usage of
    the same request run reports it, and runs nothing: the engine looked up no prompt."""
    edge = stack.edge()
    worker = stack.worker()
    ask = [{"role": "user", "content": "one two three"}]

    async def looked_up() -> float:
        async with httpx.AsyncClient() as http:
            return metric_value((await http.get(worker.metrics_url)).text,
                                "tokenbus_worker_prefix_cache_queries_total", {"model": stack.model})

    async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
        raw = await client.messages.with_raw_response.count_tokens(model=stack.model, messages=ask,
                                                                   system="four five")
        counted = MessageTokensCount.model_validate_json(raw.http_response.content, strict=True)
        assert await looked_up() == 0
        asked = await client.messages.create(model=stack.model, max_tokens=1, system="four five", messages=ask)
    assert counted.input_tokens == asked.usage.input_tokens == 5
    assert await looked_up() == 5
    await stack.settled()


async def test_errors_come_in_anthropic_s_shape(stack: Stack) -> None:
    """A bad body, an image, an unknown model, a tool result for no call, a call answered twice, more tool results
    than a conversation holds messages: each a 4xx with {"type": "error", "error": {"type", "message"}}, which the
    SDK raises as its own exception."""
    edge = stack.edge()
    stack.worker()
    async with httpx.AsyncClient(timeout=10) as http:
        missing = await http.post(edge.url + "/v1/messages", json={"model": stack.model, "messages": ASK})
    assert missing.status_code == 400
    assert missing.json()["type"] == "error" and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18"}
    orphan = [{"role": "user", "content": [result]}]
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
    twice = [*ASK, call, {"role": "user", "content": [result] * 2}]
    many = [*ASK, call, {"role": "user", "content": [result] * 130_000}]  # the review's 7.9 MB
    async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError, match="'image' are not supported"):
            await client.messages.create(model=stack.model, max_tokens=5, messages=image)
        with pytest.raises(anthropic.BadRequestError, match="toolu_1"):
            await client.messages.create(model=stack.model, max_tokens=5, messages=orphan)
        with pytest.raises(anthropic.BadRequestError, match=r"toolu_1.*messages\[2\]\.content\[1\]\.tool_use_id"):
            await client.messages.create(model=stack.model, max_tokens=5, messages=twice)
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[2\]\.content.*2048") as long:
            await client.messages.count_tokens(model=stack.model, messages=many)
        with pytest.raises(anthropic.NotFoundError) as found:
            await client.messages.create(model="nobody", max_tokens=5, messages=ASK)
    assert found.value.body["error"]["type"] == "not_found_error"
    assert long.value.body["error"]["type"] == "invalid_request_error"
    await stack.settled()


async def test_keys_go_in_x_api_key_and_their_limits_hold(stack: Stack) -> None:
    """The SDK sends its key in `x-api-key`: a wrong one is a 401 authentication_error, a key past its requests
    a minute a 429 rate_limit_error, as the SDK's own exceptions."""
    edge = stack.edge(auth="keys")
    stack.worker()
    client_redis = aioredis.Redis.from_url(stack.url)
    try:
        key, _record = await apikeys.create(client_redis, apikeys.KeyChanges(tenant="claude", rpm=2))
    finally:
        await client_redis.aclose()
    async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="not-a-key", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model=stack.model, max_tokens=2, messages=ASK)
    async with anthropic.AsyncAnthropic(base_url=edge.url, api_key=key, max_retries=0) as client:
        for _ in range(2):
            message = await client.messages.create(model=stack.model, max_tokens=2, messages=ASK)
            assert message.content[0].text == expected(2)
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.create(model=stack.model, max_tokens=2, messages=ASK)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    await stack.settled()


async def test_a_cut_message_stream_resumes_from_its_last_event(stack: Stack) -> None:
    """A client that asks for event ids (Accept: text/event-stream) and drops the stream after four events gets the
    rest from /v1/streams/{id} on another edge after its Last-Event-ID: the whole answer once, in Anthropic's
    events."""
    edge, other = stack.edge(resume_window_s=30), stack.edge(resume_window_s=30)
    stack.worker()
    body = {"model": stack.model, "max_tokens": 30, "messages": ASK, "stream": True}
    seen: list[tuple[str, dict[str, Any]]] = []
    async with httpx.AsyncClient(timeout=30, headers={"Accept": "text/event-stream"}) as http:
        async with http.stream("POST", edge.url + "/v1/messages", json=body) as response:
            event_id = ""
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    seen.append((event_id, json.loads(line[6:])))
                    if len(seen) == 4:
                        break
        stream_id = event_id.rpartition(":")[0]
        async with http.stream("GET", f"{other.url}/v1/streams/{stream_id}",
                               headers={"Last-Event-ID": event_id}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    seen.append((event_id, json.loads(line[6:])))
    events = [EVENTS.validate_python(data) for _id, data in seen if data["type"] != "ping"]
    assert [int(event_id.rpartition(":")[2]) for event_id, _data in seen] == list(range(len(seen)))
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == expected(30)
    assert events[-1].type == "message_stop"
    await stack.settled()
