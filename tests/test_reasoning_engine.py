"""Reasoning on the real engine: the session's worker runs with `--reasoning-parser qwen3`. SmolLM2 does not
think by itself, so vLLM's `structured_outputs` regex makes it write a `<think>` block and then an answer,
as a thinking model would; the parser on the worker splits what the engine generated, and the official SDK
reads the reasoning where vLLM puts it (Chat) and as OVMS's reasoning item and events (Responses), streamed
and not, with every body and event checked against OpenAI's schema. Without a block, nothing changes."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.openapi import validate
from tests.processes import MODEL, Edge

pytestmark = pytest.mark.engine

THOUGHT = r"[a-z]{1,10}( [a-z]{1,10}){2,6}"
ANSWER = r"[A-Z][a-z]{1,10}( [a-z]{1,10}){1,5}\."
THINK_THEN_ANSWER = {"structured_outputs": {"regex": f"<think>{THOUGHT}</think>{ANSWER}"}}
ASK = [{"role": "user", "content": "Is the sky blue? Think first."}]


async def test_a_chat_answer_keeps_its_reasoning_apart(client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, extra_body=THINK_THEN_ANSWER)
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    message, usage = body["choices"][0]["message"], body["usage"]
    assert re.fullmatch(THOUGHT, message["reasoning"]) and message["reasoning_content"] == message["reasoning"]
    assert re.fullmatch(ANSWER, message["content"]) and "<think>" not in message["content"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    assert usage["reasoning_tokens"] == usage["completion_tokens_details"]["reasoning_tokens"]

    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, extra_body=THINK_THEN_ANSWER, stream=True,
        stream_options={"include_usage": True})
    reasoning, content, streamed_usage = [], [], None
    async for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        if chunk.usage:
            streamed_usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning") or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (message["reasoning"], message["content"])
    assert streamed_usage is not None and streamed_usage.model_dump()["reasoning_tokens"] == usage["reasoning_tokens"]


async def test_an_answer_without_a_block_is_served_as_without_a_parser(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20,
        temperature=0)
    message = completion.choices[0].message
    assert message.content and "reasoning" not in (message.model_extra or {})
    assert completion.usage is not None and completion.usage.completion_tokens_details is not None
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0


async def test_a_response_streams_a_reasoning_item_before_its_message(served: Edge) -> None:
    body = {"model": MODEL, "input": ASK[0]["content"], "max_output_tokens": 200, "temperature": 0, "stream": True,
            "reasoning": {"effort": "low"}, **THINK_THEN_ANSWER}
    events = []
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http, \
            http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    for event in events:
        validate("ResponseStreamEvent", event)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    final = events[-1]["response"]
    assert final["status"] == "completed" and [item["type"] for item in final["output"]] == ["reasoning", "message"]
    thought = final["output"][0]["content"][0]["text"]  # the raw reasoning, as OpenAI's and vLLM's
    assert final["output"][0]["summary"] == []
    assert re.fullmatch(THOUGHT, thought) and re.fullmatch(ANSWER, final["output_text"])
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert final["reasoning"]["effort"] == "low"
