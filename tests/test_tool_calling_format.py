"""Function calling at the edge, without Redis: the checks on tools, tool choices and conversations with
calls (each a 400 naming its field), the job they become (a forced choice is a constraint), and what the
Chat and Responses renderers make of tool-call deltas, checked against OpenAI's schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.edge import framing
from services.edge.formats import calling, chat, response_render, responses
from services.edge.formats.base import decode
from services.edge.sse import DONE
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest
from tests.openapi import validate

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat_job(**fields: Any) -> bus.Job:
    body = json.dumps({"model": "m", "messages": [USER], **fields}).encode()
    return chat.to_job(decode(body, chat.ChatCompletionRequest), job_id="chatcmpl-1", reply_to="r", deadline_ms=1)


def responses_job(**fields: Any) -> tuple[bus.Job, responses.ResponsesRequest]:
    body = json.dumps({"model": "m", "input": "Weather in Paris?", **fields}).encode()
    req = decode(body, responses.ResponsesRequest)
    responses.refuse_unsupported(req)
    job = responses.to_job(req, responses.input_messages(req), job_id="resp_1", reply_to="r", deadline_ms=1)
    return job, req


def function(name: str, properties: int = 1) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string"} for i in range(properties)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [function(f"f{i}") for i in range(129)]}, "tools"),
        ({"tools": [function("f", properties=6000)]}, "tools"),  # its parameters' bytes
        ({"tools": [function("f"), function("f")]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [USER, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
        ({"messages": [USER, {"role": "tool", "content": "18 C", "tool_call_id": "call_9"}]},
         "messages[1].tool_call_id"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "18 C",
          "tool_call_id": "call_1"}, {"role": "tool", "content": "19 C", "tool_call_id": "call_1"}]},
         "messages[3].tool_call_id"),  # one call, two results (OpenAI: "Duplicate value for 'tool_call_id'")
        ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}]},
         "messages[1].tool_calls[0].type"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tools_and_conversations_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_job(**fields)
    assert (caught.value.param, caught.value.status) == (param, 400)


def test_a_call_made_again_with_its_id_is_answered_again() -> None:
    """Some models' call ids restart each turn (Kimi K2's `functions.get_weather:0`): a later assistant message
    making a call of the same id makes a new call, with a result of its own; two calls of one id, two results."""
    result = {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    called = {"role": "assistant", "tool_calls": [CALL]}
    job = chat_job(messages=[USER, called, result, called, result])
    assert [m.tool_call_id for m in job.messages if m.role == "tool"] == ["call_1", "call_1"]
    both = chat_job(messages=[USER, {"role": "assistant", "tool_calls": [CALL, CALL]}, result, result])
    assert [m.tool_call_id for m in both.messages if m.role == "tool"] == ["call_1", "call_1"]
    with pytest.raises(InvalidRequest) as caught:
        chat_job(messages=[USER, called, result, called, result, result])
    assert caught.value.param == "messages[5].tool_call_id" and "call_1" in caught.value.message


def test_the_limits_are_databricks_own() -> None:
    assert chat_job(tools=[function(f"f{i}", properties=15) for i in range(32)]).tool_use is not None


def test_a_conversation_with_calls_reaches_the_worker() -> None:
    object_arguments = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # Databricks
    job = chat_job(tools=[WEATHER], parallel_tool_calls=False, messages=[
        USER, {"role": "assistant", "content": None, "tool_calls": [CALL, {**object_arguments, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"}]}])
    assert job.messages[1] == bus.Message(role="assistant", content="", tool_calls=[
        bus.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
        bus.ToolCall(id="call_2", name="get_weather", arguments='{"city":"Paris"}')])
    assert [(m.role, m.content, m.tool_call_id) for m in job.messages[2:]] == [
        ("tool", "18 C", "call_1"), ("tool", "sunny", "call_2")]
    assert job.tool_use == bus.ToolUse(tools=[bus.Tool(name="get_weather", description="The weather in a city.",
                                                       parameters=WEATHER["function"]["parameters"])],
                                       choice="auto", parallel=False)
    assert job.params.constraint is None  # auto: the worker's parser reads free text


def test_without_tools_there_is_no_tool_use_and_none_offers_nothing_to_call() -> None:
    assert chat_job().tool_use is None and chat_job(tool_choice="auto").tool_use is None
    none = chat_job(tools=[WEATHER], tool_choice="none")
    assert none.tool_use is not None and none.tool_use.choice == "none" and none.params.constraint is None


def test_a_named_choice_is_forced_by_the_function_s_parameters() -> None:
    job = chat_job(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert job.tool_use is not None and (job.tool_use.choice, job.tool_use.name) == ("function", "get_weather")
    assert job.params.constraint == bus.Constraint(kind="json", spec=json.dumps(
        WEATHER["function"]["parameters"], separators=(",", ":")))


def test_required_is_forced_as_an_array_of_calls() -> None:
    defs = {"$defs": {"Unit": {"enum": ["c", "f"]}}}
    temperature = {"type": "function", "function": {"name": "temperature", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, **defs}}}
    job = chat_job(tools=[WEATHER, temperature, {"type": "function", "function": {"name": "now"}}],
                   tool_choice="required", parallel_tool_calls=False)
    assert job.params.constraint is not None
    schema = json.loads(job.params.constraint.spec)
    assert (schema["type"], schema["minItems"], schema["maxItems"], schema["$defs"]) == ("array", 1, 1, defs["$defs"])
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["temperature"], ["now"]]
    assert schema["items"]["anyOf"][2]["properties"]["arguments"] == calling.NO_PARAMETERS
    assert "maxItems" not in json.loads(chat_job(tools=[WEATHER], tool_choice="required").params.constraint.spec)


def test_a_forced_choice_and_a_response_format_do_not_mix() -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_job(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.param == "response_format"


# Chat rendering


def deltas(job_id: str = "chatcmpl-1") -> list[bus.Tokens | bus.Final]:
    call = "call_abc"
    return [
        bus.Tokens(job=job_id, text="Let me look.", token_ids=[1, 2]),
        bus.Tokens(job=job_id, text="", token_ids=[3], tool_calls=[bus.ToolCallDelta(index=0, id=call,
                                                                                     name="get_weather")]),
        bus.Tokens(job=job_id, text="", token_ids=[4], tool_calls=[bus.ToolCallDelta(index=0, arguments='{"city"')]),
        bus.Tokens(job=job_id, text="", token_ids=[5], finish_reason="tool_calls",
                   tool_calls=[bus.ToolCallDelta(index=0, arguments=': "Paris"}')]),
        bus.Final(job=job_id, prompt_tokens=9, completion_tokens=5),
    ]


def test_a_streamed_call_is_sent_as_openai_tool_call_deltas() -> None:
    req = decode(json.dumps({"model": "m", "messages": [USER], "tools": [WEATHER], "stream": True}).encode(),
                 chat.ChatCompletionRequest)
    renderer = chat.ChatRenderer(req, response_id="chatcmpl-1", created=1)
    frames = framing.frames([p for event in deltas() for p in renderer.render(event)] + renderer.done())
    assert frames[-1] == DONE
    chunks = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Let me look."},
        {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]},
        {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_body_carries_the_calls_and_null_content_without_text() -> None:
    req = decode(json.dumps({"model": "m", "messages": [USER], "tools": [WEATHER]}).encode(),
                 chat.ChatCompletionRequest)
    renderer = chat.ChatRenderer(req, response_id="chatcmpl-1", created=1)
    for event in deltas()[1:]:
        renderer.render(event)
    body = json.loads(framing.body(renderer.body()))
    validate("CreateChatCompletionResponse", body)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"] == {
        "role": "assistant", "content": None, "refusal": None,
        "tool_calls": [{"id": "call_abc", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


# Responses


FLAT = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": WEATHER["function"]["parameters"], "strict": True}


def test_flat_and_nested_function_tools_are_the_same_function() -> None:
    flat, _ = responses_job(tools=[FLAT])
    nested, _ = responses_job(tools=[{"type": "function", "function": {**WEATHER["function"], "strict": True}}])
    assert flat.tool_use == nested.tool_use and flat.tool_use is not None
    assert flat.tool_use.tools[0].strict


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"tools": [{"type": "web_search"}]}, "tools[0]"),
     ({"tools": [{"type": "function"}]}, "tools[0].name"),
     ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters"),
     ({"tools": [FLAT], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
     ({"tools": [FLAT], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
     ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "18 C"}]}, "input[0].call_id"),
     ({"input": [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                 {"type": "function_call_output", "call_id": "call_1", "output": "19 C"}]}, "input[2].call_id"),
     ({"input": [{"type": "function_call", "call_id": "call_1", "name": "get_weather"}]}, "input[0].arguments"),
     ({"input": [{"type": "function_call_output", "call_id": "call_1"}]}, "input[0].output"),
     ({"input": [{"content": "hi"}]}, "input[0].role"),
     ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type")],
)
def test_responses_refusals_name_their_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        responses_job(**fields)
    assert caught.value.param == param


def test_function_call_items_and_their_outputs_become_the_conversation() -> None:
    job, _ = responses_job(tools=[FLAT], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": {"city": "Lyon"}},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": {"celsius": 20}}])
    assert [(m.role, m.content, [c.id for c in m.tool_calls], m.tool_call_id) for m in job.messages] == [
        ("user", "Weather in Paris?", [], ""), ("assistant", "", ["call_1", "call_2"], ""),
        ("tool", "18 C", [], "call_1"), ("tool", '{"celsius":20}', [], "call_2")]


def test_a_result_may_answer_a_call_of_the_previous_response() -> None:
    req = decode(json.dumps({"model": "m", "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]}).encode(),
        responses.ResponsesRequest)
    earlier = [bus.Message(role="assistant", content="", tool_calls=[bus.ToolCall(id="call_1", name="get_weather")])]
    assert responses.input_messages(req, earlier) == [bus.Message(role="tool", content="18 C", tool_call_id="call_1")]


def test_a_result_may_not_answer_a_call_the_previous_responses_answered() -> None:
    req = decode(json.dumps({"model": "m", "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "19 C"}]}).encode(),
        responses.ResponsesRequest)
    called = bus.Message(role="assistant", content="", tool_calls=[bus.ToolCall(id="call_1", name="get_weather")])
    answered = [called, bus.Message(role="tool", content="18 C", tool_call_id="call_1")]
    with pytest.raises(InvalidRequest) as caught:
        responses.input_messages(req, answered)
    assert caught.value.param == "input[0].call_id" and "call_1" in caught.value.message
    assert responses.input_messages(req, [*answered, called])  # the id made again: a new call


def render_responses(req: responses.ResponsesRequest, events: list[bus.Tokens | bus.Final]
                     ) -> list[dict[str, Any]]:
    renderer = response_render.ResponsesRenderer(req, response_id="resp_1", created_at=1)
    frames = [f for event in events for f in framing.frames(renderer.render(event))]
    return [json.loads(f.split(b"data: ", 1)[1]) for f in frames]


def test_a_streamed_response_opens_fills_and_closes_each_item_in_order() -> None:
    _job, req = responses_job(tools=[FLAT], stream=True)
    events = render_responses(req, deltas("resp_1"))
    for event in events:
        validate("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, done = events[8], events[12]
    # the item id names its response (resp_1): an item_reference to it finds it
    assert added["item"] == {"id": "fc_1", "type": "function_call", "call_id": "call_abc", "name": "get_weather",
                             "arguments": "", "status": "in_progress"}
    assert (added["output_index"], done["output_index"]) == (1, 1)
    assert done["item"] == {**added["item"], "arguments": '{"city": "Paris"}', "status": "completed"}
    assert events[11]["arguments"] == '{"city": "Paris"}' and events[11]["name"] == "get_weather"
    final = events[-1]["response"]
    validate("Response", final)
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output_text"] == "Let me look."
    assert final["tools"] == [FLAT] and final["tool_choice"] == "auto"


def test_a_call_without_text_is_the_only_item_and_a_named_choice_is_echoed_flat() -> None:
    _job, req = responses_job(tools=[{"type": "function", "function": WEATHER["function"]}],
                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    renderer = response_render.ResponsesRenderer(req, response_id="resp_1", created_at=1)
    for event in deltas("resp_1")[1:]:
        renderer.render(event)
    body = json.loads(framing.body(renderer.body()))
    validate("Response", body)
    assert [item["type"] for item in body["output"]] == ["function_call"] and body["output_text"] == ""
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert body["tools"][0] == {**FLAT, "strict": None}
    assert renderer.items.answer() == bus.Message(role="assistant", content="", tool_calls=[
        bus.ToolCall(id="call_abc", name="get_weather", arguments='{"city": "Paris"}')])


def test_admission_counts_the_functions_and_calls_a_prompt_holds() -> None:
    from services.edge.estimate import estimate

    plain = estimate(chat_job(max_tokens=5), 2048)[0]
    offered = estimate(chat_job(max_tokens=5, tools=[WEATHER]), 2048)[0]
    silent = estimate(chat_job(max_tokens=5, tools=[WEATHER], tool_choice="none"), 2048)[0]
    answered = estimate(chat_job(max_tokens=5, messages=[USER, {"role": "assistant", "tool_calls": [CALL]}]), 2048)[0]
    assert offered > plain + 20 and silent == plain and answered > plain + 4 + 5
