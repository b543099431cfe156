"""The Responses API: bodies, typed stream events, the SDK's stream helper, stored responses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.openapi import sse_events, validate
from tests.processes import MODEL, Edge, start_edge, stop_process

pytestmark = pytest.mark.engine

QUESTION = "What is the capital of France?"
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def test_a_response_answers_and_matches_the_schema(client: openai.AsyncOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=QUESTION, temperature=0, instructions="Answer in one sentence.",
        metadata={"ticket": "42"}, user="u-1",
    )
    body = raw.http_response.json()
    validate("Response", body)
    response = raw.parse()
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.completed_at is not None
    assert "Paris" in response.output_text
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert (response.instructions, response.metadata, response.user) == ("Answer in one sentence.", {"ticket": "42"},
                                                                          "u-1")
    usage = response.usage
    assert usage is not None and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


async def test_input_items_with_text_parts(client: openai.AsyncOpenAI) -> None:
    items = [
        {"role": "developer", "content": "You answer in one sentence."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    response = await client.responses.create(model=MODEL, input=items, temperature=0)
    assert "Paris" in response.output_text


async def test_stream_events_in_order_with_rising_sequence_numbers(served: Edge) -> None:
    events = await sse_events(served.url + "/v1/responses",
                              {"model": MODEL, "input": QUESTION, "temperature": 0, "stream": True})
    for name, data in events:
        validate("ResponseStreamEvent", data)
        assert name == data["type"]
    types = [data["type"] for _name, data in events]
    assert types[:4] == EVENT_ORDER
    deltas = [t for t in types[4:-4]]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert types[-4:] == [*CLOSING, "response.completed"]
    assert [data["sequence_number"] for _n, data in events] == list(range(len(events)))
    text = "".join(data["delta"] for _n, data in events if data["type"] == "response.output_text.delta")
    assert events[-1][1]["response"]["output_text"] == text
    assert "Paris" in text


async def test_the_sdk_stream_helper_reports_the_final_response(client: openai.AsyncOpenAI) -> None:
    deltas = []
    async with client.responses.stream(model=MODEL, input=QUESTION, temperature=0) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert "Paris" in final.output_text


async def test_a_small_max_output_tokens_is_incomplete(served: Edge, client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 5
    events = await sse_events(served.url + "/v1/responses", {"model": MODEL, "input": "Tell me a long story.",
                                                              "max_output_tokens": 5, "stream": True})
    assert events[-1][1]["type"] == "response.incomplete"
    assert events[-2][1]["item"]["status"] == "incomplete"


@pytest.fixture(scope="module")
def second_edge(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    edge = start_edge(redis_url, Path(tmp_path_factory.mktemp("edge2")), name="edge2")
    yield edge
    stop_process(edge.process)


async def test_a_conversation_continues_on_another_edge(client: openai.AsyncOpenAI, second_edge: Edge) -> None:
    first = await client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=20)
    async with openai.AsyncOpenAI(base_url=second_edge.url + "/v1", api_key="unused", max_retries=0) as other:
        fetched = await other.responses.retrieve(first.id)
        assert fetched.output_text == first.output_text
        second = await other.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                              previous_response_id=first.id, max_output_tokens=20)
    assert second.previous_response_id == first.id
    # the second turn saw the whole first one: its question, the answer, then the new question
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


async def test_input_tokens_counts_what_the_response_reads(client: openai.AsyncOpenAI) -> None:
    """responses.input_tokens.count counts the input as the model reads it (the instructions, the responses it
    continues, the tools the template shows), exactly the usage of the same turn run."""
    first = await client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=8)
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    turn: dict[str, Any] = {"model": MODEL, "input": "What is my name?", "instructions": "Answer briefly.",
                            "previous_response_id": first.id, "tools": tools}
    raw = await client.responses.input_tokens.with_raw_response.count(**turn)
    validate("TokenCountsResource", raw.http_response.json())
    counted = raw.parse()
    ran = await client.responses.create(**turn, max_output_tokens=1, store=False)
    assert ran.usage is not None and counted.input_tokens == ran.usage.input_tokens
    bare = await client.responses.input_tokens.count(model=MODEL, input="What is my name?")
    assert counted.object == "response.input_tokens" and 0 < bare.input_tokens < counted.input_tokens
    assert (await client.responses.input_tokens.count(input="What is my name?")).input_tokens == bare.input_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.input_tokens.count(model=MODEL, input="Hi", previous_response_id="resp_missing")
    assert (caught.value.code, caught.value.param) == ("previous_response_not_found", "previous_response_id")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.input_tokens.count(model=MODEL)
    assert refused.value.body["param"] == "input"


async def test_an_item_reference_reads_as_the_item_it_names(client: openai.AsyncOpenAI) -> None:
    """An `item_reference` input item (typed, or OpenAI's untyped form) reads as the stored item it names: a
    response's output message or its listed input, counted exactly as the same item sent whole."""
    first = await client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=8)
    answer = first.output[0]
    listed = [item async for item in client.responses.input_items.list(first.id)]
    assert answer.id.startswith("msg_") and listed[0].id.startswith("msg_")
    question = {"role": "user", "content": "What is my name?"}
    referenced = [{"type": "item_reference", "id": listed[0].id}, {"id": answer.id}, question]
    whole = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": first.output_text}, question]
    counted = await client.responses.input_tokens.count(model=MODEL, input=referenced)
    assert counted.input_tokens == (await client.responses.input_tokens.count(
        model=MODEL, input=whole)).input_tokens
    ran = await client.responses.create(model=MODEL, input=referenced, max_output_tokens=1)
    assert ran.usage is not None and ran.usage.input_tokens == counted.input_tokens
    # the new response lists the items as they were read: the referenced ones with their own ids
    assert [item.id async for item in client.responses.input_items.list(ran.id, order="asc")][:2] == [
        listed[0].id, answer.id]
    await client.responses.delete(first.id)  # its items go with it
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input=referenced, max_output_tokens=1)
    assert caught.value.body["param"] == "input[0].id" and listed[0].id in caught.value.body["message"]


async def test_a_deleted_response_is_gone(client: openai.AsyncOpenAI, second_edge: Edge) -> None:
    response = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    async with openai.AsyncOpenAI(base_url=second_edge.url + "/v1", api_key="unused", max_retries=0) as other:
        await other.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:  # OpenAI's 400: a client sends its whole history again
        await client.responses.create(model=MODEL, input="Again", previous_response_id=response.id)
    assert (caught.value.code, caught.value.param) == ("previous_response_not_found", "previous_response_id")


async def test_store_false_keeps_nothing(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"background": True, "store": False}, "store"), ({"conversation": {"name": "x"}}, "conversation"),
     ({"service_tier": "flex"}, "service_tier"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
     ({"tools": [{"type": "web_search"}]}, "tools[0]"), ({"temperature": 3}, "temperature"),
     ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"), ({"extra_body": {"n": 2}}, "n"),
     ({"text": {"format": {"type": "json_object"}}, "tool_choice": "required",  # one constraint at a time
       "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "text.format")],
)
async def test_unsupported_parameters_are_named(
    client: openai.AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input="Hi", **extra)
    assert caught.value.body["param"] == param


async def test_top_logprobs_fill_the_output_text(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model=MODEL, input=QUESTION, temperature=0, top_logprobs=2,
                                             max_output_tokens=6)
    part = response.output[0].content[0]
    assert part.type == "output_text" and part.logprobs
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in part.logprobs)
    assert all(top.bytes == list(top.token.encode()) for lp in part.logprobs for top in lp.top_logprobs)


async def test_include_asks_for_the_output_text_s_logprobs(client: openai.AsyncOpenAI) -> None:
    """OpenAI's documented way to have them: `include`, no top_logprobs."""
    response = await client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=6,
                                             include=["message.output_text.logprobs"])
    part = response.output[0].content[0]
    assert part.type == "output_text" and "".join(lp.token for lp in part.logprobs or []) == part.text != ""
    async with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=6,
                                       include=["message.output_text.logprobs"]) as stream:
        deltas = [event async for event in stream if event.type == "response.output_text.delta"]
    assert all(len(delta.logprobs) == 1 for delta in deltas)


async def test_truncation_auto_drops_the_oldest_turns(client: openai.AsyncOpenAI) -> None:
    filler = "The sea is deep and wide. " * 150  # about 1,000 tokens a turn
    turns = [{"role": "user", "content": filler}, {"role": "assistant", "content": filler},
             {"role": "user", "content": QUESTION}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input=turns, max_output_tokens=16)
    assert caught.value.body["code"] == "context_length_exceeded"
    response = await client.responses.create(model=MODEL, input=turns, max_output_tokens=16, temperature=0,
                                             truncation="auto")
    assert response.status in ("completed", "incomplete")
    assert response.usage is not None and response.usage.input_tokens < 2048 - 16
