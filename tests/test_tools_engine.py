"""Function calling on the real engine, with the official SDK: a tool loop (tool_choice required, the tool's
result sent back, a final answer) in Chat Completions and in the Responses API, streamed and not, every body
and event checked against OpenAI's schema; streamed calls accumulate to the unstreamed ones (greedy);
arguments validate against the function's parameters; the limits are 400s; Databricks' and OVMS's routes
serve the same. A 135M model cannot call functions by itself: the forced choices' constraint makes it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.openapi import sse_events, validate
from tests.processes import MODEL, Edge

pytestmark = pytest.mark.engine

WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": f"The {name[4:]} in a city.", "parameters": schema}}
    for name, schema in PARAMETERS.items()]
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
QUESTION = "What is the weather like in Paris right now?"
ASK = [{"role": "user", "content": QUESTION}]
FORCED = {"model": MODEL, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
          "temperature": 0, "max_tokens": 60}


def run_tool(name: str, arguments: str) -> str:
    """The client's side of the loop: the function, run on the model's arguments (validated first)."""
    values = json.loads(arguments)
    jsonschema.validate(values, PARAMETERS[name])
    return f"{values['city']}: 18 degrees, sunny." if name == "get_weather" else f"{values['city']}: 14:05."


def accumulate(deltas: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A stream's tool-call deltas into calls, checking their shape: id, type and name first, then arguments."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert delta["id"].startswith("call_") and delta["type"] == "function" and delta["function"]["name"]
            calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
        else:
            assert "id" not in delta and "name" not in delta["function"]
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


async def streamed_chat(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """Content, calls and finish reason of a streamed chat answer, every chunk checked against the schema."""
    content, deltas, finish = "", [], None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        raw = chunk.to_dict()
        validate("CreateChatCompletionStreamResponse", raw)
        delta = raw["choices"][0]["delta"]
        content += delta.get("content") or ""
        deltas += delta.get("tool_calls", [])
        finish = raw["choices"][0]["finish_reason"] or finish
    return content, accumulate(deltas), finish


async def test_a_chat_tool_loop_streamed_and_not(client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(messages=ASK, **FORCED)
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    result = run_tool(call["function"]["name"], call["function"]["arguments"])

    content, streamed, finish = await streamed_chat(client, messages=ASK, **FORCED)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (call["function"]["name"], call["function"]["arguments"])]  # greedy: the same call, delta by delta

    turn = [*ASK, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": result}]
    final = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30)
    answer = final.http_response.json()
    validate("CreateChatCompletionResponse", answer)
    assert answer["choices"][0]["message"]["content"] and "tool_calls" not in answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    content, calls, finish = await streamed_chat(client, model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                                 temperature=0, max_tokens=30)
    assert (content, calls, finish) == (answer["choices"][0]["message"]["content"], [],
                                        answer["choices"][0]["finish_reason"])


async def test_a_named_function_is_called_with_valid_arguments(client: openai.AsyncOpenAI) -> None:
    kwargs = {**FORCED, "messages": [{"role": "user", "content": "What time is it in Lima?"}],
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "temperature": 1.0, "seed": 5}
    # the two compared requests both read the prompt from vLLM's prefix cache: in bfloat16 on a GPU a cached
    # prefix gives logits a hair off a full prefill's, enough for a sampled answer to go another way
    await client.chat.completions.create(**kwargs)
    answer = await client.chat.completions.create(**kwargs)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and answer.choices[0].finish_reason == "tool_calls"
    run_tool(call.function.name, call.function.arguments)
    _content, streamed, _finish = await streamed_chat(client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]


async def test_a_tool_result_reaches_the_model(client: openai.AsyncOpenAI) -> None:
    """The result is in the prompt: a longer one costs more prompt tokens (one token generated each)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Lima"}'}}
    usage = []
    for result in ("14:05", "14:05, measured at the cathedral clock on the main square of the old town"):
        turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}]
        answer = await client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=1)
        usage.append(answer.usage.prompt_tokens)
    assert usage[1] - usage[0] >= 10


async def test_a_responses_tool_loop_with_previous_response_id(client: openai.AsyncOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=QUESTION, tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=60)
    body = raw.http_response.json()
    validate("Response", body)
    [item] = body["output"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert (body["tool_choice"], body["parallel_tool_calls"], body["tools"]) == (
        "required", False, [{**tool, "strict": None} for tool in FLAT_TOOLS])
    result = run_tool(item["name"], item["arguments"])
    final = await client.responses.with_raw_response.create(
        model=MODEL, previous_response_id=body["id"], tools=FLAT_TOOLS, tool_choice="none", temperature=0,
        max_output_tokens=30, input=[{"type": "function_call_output", "call_id": item["call_id"], "output": result}])
    answer = final.http_response.json()
    validate("Response", answer)
    assert [i["type"] for i in answer["output"]] == ["message"] and answer["output_text"]


async def test_a_streamed_responses_tool_loop_with_the_whole_input(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "input": QUESTION, "tools": FLAT_TOOLS, "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 60}
    unstreamed = await client.responses.create(**kwargs)
    events = [event.to_dict() async for event in await client.responses.create(**kwargs, stream=True)]
    for event in events:
        validate("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = events[-2]["item"]
    assert arguments == events[-3]["arguments"] == done["arguments"]
    assert (done["name"], done["arguments"]) == (unstreamed.output[0].name, unstreamed.output[0].arguments)
    result = run_tool(done["name"], done["arguments"])
    turn = [{"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": done["call_id"], "name": done["name"], "arguments": done["arguments"]},
            {"type": "function_call_output", "call_id": done["call_id"], "output": result}]
    final = [event.to_dict() async for event in await client.responses.create(
        model=MODEL, input=turn, tools=FLAT_TOOLS, tool_choice="none", temperature=0, max_output_tokens=30,
        stream=True)]
    for event in final:
        validate("ResponseStreamEvent", event)
    assert final[-1]["type"] in ("response.completed", "response.incomplete")
    assert final[-1]["response"]["output_text"] and final[-1]["response"]["output"][0]["type"] == "message"


@pytest.mark.parametrize(
    ("api", "tools", "param"),
    [("chat", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "tools"),
     ("chat", [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}}}], "tools"),
     ("responses", [{"type": "function", "name": f"f{i}", "parameters": {}} for i in range(129)], "tools"),
     ("responses", [{"type": "function", "name": "f", "parameters": {"type": "string"}}], "tools[0].parameters")],
)
async def test_more_than_128_functions_or_128_kb_of_parameters_are_a_400(
    client: openai.AsyncOpenAI, api: str, tools: list[dict[str, Any]], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if api == "chat":
            await client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=4)
        else:
            await client.responses.create(model=MODEL, input=QUESTION, tools=tools, max_output_tokens=4)
    assert caught.value.body["param"] == param
    validate("ErrorResponse", {"error": caught.value.body})


async def test_databricks_and_ovms_routes_call_functions(served: Edge) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        databricks = await http.post(f"{served.url}/serving-endpoints/{MODEL}/invocations", json={
            "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60, "temperature": 0})
    assert databricks.status_code == 200, databricks.text
    [call] = databricks.json()["choices"][0]["message"]["tool_calls"]
    run_tool(call["function"]["name"], call["function"]["arguments"])
    nested = [{"type": "function", "function": tool["function"]} for tool in TOOLS]  # OVMS's nested form
    events = await sse_events(served.url + "/v3/responses", {
        "model": MODEL, "input": QUESTION, "tools": nested, "stream": True, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_output_tokens": 60})
    assert events[-1] == (None, "[DONE]")
    response = events[-2][1]["response"]
    validate("Response", response)
    [item] = response["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert response["tool_choice"] == {"type": "function", "name": "get_weather"}
    run_tool(item["name"], item["arguments"])
