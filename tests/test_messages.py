"""Anthropic's Messages API on the real engine (SmolLM2, greedy), with the official `anthropic` SDK: the answer
streamed and not (the SDK's stream accumulating the same message), its prompt counted by count_tokens exactly as
the engine counted it (and as Chat Completions counts the same conversation), a stop sequence named, a tool loop
(a forced call, its tool_result sent back, an answer) and thinking blocks from the worker's reasoning parser. Every
body is parsed by the SDK's own types."""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from anthropic.types import Message

from tests.processes import MODEL, Edge

pytestmark = pytest.mark.engine

ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
SYSTEM = "You answer briefly."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}]
THOUGHT = r"[a-z]{1,10}( [a-z]{1,10}){2,6}"
ANSWER = r"[A-Z][a-z]{1,10}( [a-z]{1,10}){1,5}\."


@pytest.fixture
async def claude(served: Edge) -> Any:
    async with anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


GREEDY = {"temperature": 0}
"""The SDK no longer offers sampling parameters (Anthropic's newest models fixed them); vLLM's and tokenbus's Messages
API still take them, sent in the body."""


def blocks(message: Message) -> list[dict[str, Any]]:
    """A message's content as plain data (a streamed message's blocks are the SDK's Parsed* subclasses)."""
    return [block.model_dump(exclude={"parsed_output"}) for block in message.content]


async def create(client: anthropic.AsyncAnthropic, extra_body: dict[str, Any] | None = None,
                 **kwargs: Any) -> Message:
    """A greedy message, parsed strictly by the SDK's type from the bytes sent."""
    raw = await client.messages.with_raw_response.create(model=MODEL, extra_body={**GREEDY, **(extra_body or {})},
                                                         **kwargs)
    return Message.model_validate_json(raw.http_response.content, strict=True)


async def test_an_answer_streamed_and_not_and_its_prompt_counted(claude: anthropic.AsyncAnthropic,
                                                                 served: Edge) -> None:
    message = await create(claude, max_tokens=24, system=SYSTEM, messages=ASK)
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    async with claude.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=24, system=SYSTEM,
                                      messages=ASK) as stream:
        streamed = await stream.get_final_message()
    assert blocks(streamed) == blocks(message) and streamed.usage.output_tokens == message.usage.output_tokens
    counted = await claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens == streamed.usage.input_tokens
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as chat:
        completion = await chat.chat.completions.create(
            model=MODEL, max_tokens=1, messages=[{"role": "system", "content": SYSTEM}, *ASK])  # type: ignore[list-item]
    assert completion.usage is not None and completion.usage.prompt_tokens == counted.input_tokens


async def test_a_stop_sequence_ends_the_answer_and_is_named(claude: anthropic.AsyncAnthropic) -> None:
    whole = await create(claude, max_tokens=24, system=SYSTEM, messages=ASK)
    text = whole.content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = await create(claude, max_tokens=24, system=SYSTEM, messages=ASK, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]


async def test_a_tool_loop_forced_call_then_its_result(claude: anthropic.AsyncAnthropic) -> None:
    """A forced tool call (the constraint makes a 135M model write valid input), streamed and not alike; then the
    conversation with its tool_use and the tool_result sent back gets an answer in text (tool_choice none: left to
    itself, the small model calls the tool again)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    called = await create(claude, max_tokens=40, messages=ask, tools=TOOLS, tool_choice=forced)
    assert called.stop_reason == "tool_use"
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    async with claude.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=40, messages=ask,
                                      tools=TOOLS, tool_choice=forced) as stream:
        streamed = await stream.get_final_message()
    [streamed_use] = [block for block in streamed.content if block.type == "tool_use"]
    assert (streamed_use.name, streamed_use.input) == (use.name, use.input) and streamed.stop_reason == "tool_use"
    answered = await create(claude, max_tokens=24, tools=TOOLS, tool_choice={"type": "none"}, messages=[
        *ask, {"role": "assistant", "content": [block.model_dump() for block in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": f"{use.input['city']}: 18 degrees, sunny."}]}])
    assert answered.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answered.content] == ["text"] and answered.content[0].text


async def test_thinking_comes_as_thinking_blocks(claude: anthropic.AsyncAnthropic) -> None:
    """The worker's reasoning parser splits a <think> block (vLLM's structured_outputs regex makes SmolLM2 write
    one) from the answer: a thinking block, then a text block, streamed (thinking_delta, then text_delta) and not."""
    think = {"structured_outputs": {"regex": f"<think>{THOUGHT}</think>{ANSWER}"}}
    ask = [{"role": "user", "content": "Is the sky blue? Think first."}]
    message = await create(claude, max_tokens=200, messages=ask, extra_body=think)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert re.fullmatch(THOUGHT, message.content[0].thinking)
    assert re.fullmatch(ANSWER, message.content[1].text)
    deltas = []
    async with claude.messages.stream(model=MODEL, max_tokens=200, messages=ask,
                                      extra_body={**GREEDY, **think}) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                deltas.append(event.delta.type)
        streamed = await stream.get_final_message()
    assert blocks(streamed) == blocks(message)
    assert deltas == sorted(deltas, key=lambda kind: kind != "thinking_delta") and deltas[-1] == "text_delta"
    assert json.loads(streamed.model_dump_json())["content"][0]["type"] == "thinking"
