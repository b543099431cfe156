"""Reasoning at the edge, without Redis: what the Chat and Responses renderers make of a worker's reasoning
(vLLM's `reasoning` and `reasoning_content` fields; OVMS's reasoning item and summary events before the
message; the reasoning tokens in the usage), checked against OpenAI's schema; earlier turns' reasoning
coming back in; and vLLM's `structured_outputs` extension as a job's constraint."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.edge import framing
from services.edge.formats import chat, completions, response_render, responses
from services.edge.formats.base import decode
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest
from tests.openapi import validate

USER = {"role": "user", "content": "2 + 2?"}


def thinking(job_id: str) -> list[bus.Tokens | bus.Final]:
    """What a worker with a reasoning parser sends for `<think>Two and two.</think>Four.`."""
    return [
        bus.Tokens(job=job_id, text="", token_ids=[1, 2], reasoning="Two and"),
        bus.Tokens(job=job_id, text="", token_ids=[3, 4], reasoning=" two."),
        bus.Tokens(job=job_id, text="Four", token_ids=[5]),
        bus.Tokens(job=job_id, text=".", token_ids=[6], finish_reason="stop"),
        bus.Final(job=job_id, prompt_tokens=7, completion_tokens=6, reasoning_tokens=4),
    ]


def chat_request(**fields: Any) -> chat.ChatCompletionRequest:
    return decode(json.dumps({"model": "m", "messages": [USER], **fields}).encode(), chat.ChatCompletionRequest)


def test_a_streamed_chat_sends_the_reasoning_in_vllm_fields_before_the_content() -> None:
    renderer = chat.ChatRenderer(chat_request(stream=True, stream_options={"include_usage": True}),
                                 response_id="chatcmpl-1", created=1)
    frames = [f for event in thinking("chatcmpl-1") for f in framing.frames(renderer.render(event))]
    chunks = [json.loads(f.removeprefix(b"data: ")) for f in frames]
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": ""},
                      {"reasoning": "Two and", "reasoning_content": "Two and"},
                      {"reasoning": " two.", "reasoning_content": " two."},
                      {"content": "Four"}, {"content": "."}, {}]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 4 and usage["reasoning_tokens"] == 4


def test_a_chat_body_carries_the_reasoning_beside_the_content() -> None:
    renderer = chat.ChatRenderer(chat_request(), response_id="chatcmpl-1", created=1)
    for event in thinking("chatcmpl-1"):
        renderer.render(event)
    body = json.loads(framing.body(renderer.body()))
    validate("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning"], message["reasoning_content"]) == ("Four.", "Two and two.",
                                                                                       "Two and two.")
    assert body["usage"]["reasoning_tokens"] == 4


def test_an_answer_without_reasoning_looks_as_it_did() -> None:
    renderer = chat.ChatRenderer(chat_request(), response_id="chatcmpl-1", created=1)
    for event in thinking("chatcmpl-1")[2:4]:
        renderer.render(event)
    renderer.render(bus.Final(job="chatcmpl-1", prompt_tokens=7, completion_tokens=2))
    body = json.loads(framing.body(renderer.body()))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Four.", "refusal": None}
    assert "reasoning_tokens" not in body["usage"]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_an_earlier_turns_reasoning_reaches_the_template_under_either_name() -> None:
    for name in ("reasoning", "reasoning_content"):
        req = chat_request(messages=[USER, {"role": "assistant", "content": "Four.", name: "Two and two."}, USER])
        job = chat.to_job(req, job_id="j", reply_to="r", deadline_ms=1)
        assert job.messages[1].reasoning == "Two and two."


def responses_request(**fields: Any) -> responses.ResponsesRequest:
    return decode(json.dumps({"model": "m", "input": "2 + 2?", **fields}).encode(), responses.ResponsesRequest)


@pytest.mark.parametrize("ovms", [False, True], ids=["openai", "ovms"])
def test_a_streamed_response_opens_a_reasoning_item_before_the_message(ovms: bool) -> None:
    """OpenAI's (and vLLM's) form: the raw reasoning is the item's reasoning_text content, its summary empty; on
    OVMS's /v3, OVMS's form: the reasoning is the item's one summary part."""
    req = responses_request(stream=True)
    renderer = response_render.ResponsesRenderer(req, response_id="resp_1", created_at=1, ovms=ovms)
    frames = [f for event in thinking("resp_1") for f in framing.frames(renderer.render(event))]
    events = [json.loads(f.split(b"data: ", 1)[1]) for f in frames if f.startswith(b"event:")]
    for event in events:
        validate("ResponseStreamEvent", event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kind, part = ("reasoning_summary", "summary") if ovms else ("reasoning", "content")
    part_kind = "response.reasoning_summary_part" if ovms else "response.content_part"
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", f"{part_kind}.added",
        f"response.{kind}_text.delta", f"response.{kind}_text.delta",
        f"response.{kind}_text.done", f"{part_kind}.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    opened = {"id": "rs_1", "type": "reasoning", "summary": [], "status": "in_progress"}
    assert events[2]["item"] == (opened if ovms else {**opened, "content": []})
    assert events[6]["text"] == "Two and two." and events[6]["output_index"] == 0
    thought = {"type": "summary_text" if ovms else "reasoning_text", "text": "Two and two."}
    assert events[8]["item"][part] == [thought] and events[7]["part"] == thought
    if not ovms:
        assert events[8]["item"]["summary"] == []  # no summary is made of it
    assert events[9]["output_index"] == 1 and events[9]["item"]["type"] == "message"
    final = events[-1]["response"]
    validate("Response", final)
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output_text"] == "Four." and final["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    assert renderer.items.answer() == bus.Message(role="assistant", content="Four.", reasoning="Two and two.")


def test_a_reasoning_item_sent_back_goes_with_the_assistant_turn_after_it() -> None:
    req = decode(json.dumps({"model": "m", "input": [
        {"role": "user", "content": "2 + 2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Two and two."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Four."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "calc", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
        {"type": "reasoning", "id": "rs_3", "summary": [{"type": "summary_text", "text": "dangling"}]},
        {"role": "user", "content": "And 3 + 3?"}]}).encode(), responses.ResponsesRequest)
    messages = responses.input_messages(req)
    assert [(m.role, m.content, m.reasoning) for m in messages] == [
        ("user", "2 + 2?", ""), ("assistant", "Four.", "Two and two."), ("assistant", "", "Look it up."),
        ("tool", "4", ""), ("user", "And 3 + 3?", "")]


@pytest.mark.parametrize(("spec", "kind", "text"), [
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"choice": ["yes", "no"]}, "choice", '["yes","no"]'),
    ({"json": {"type": "object"}}, "json", '{"type":"object"}'),
    ({"json_object": True}, "json_object", ""),
])
def test_vllm_structured_outputs_become_the_jobs_constraint(spec: dict[str, Any], kind: str, text: str) -> None:
    job = chat.to_job(chat_request(structured_outputs=spec), job_id="j", reply_to="r", deadline_ms=1)
    assert job.params.constraint == bus.Constraint(kind=kind, spec=text)
    req = decode(json.dumps({"model": "m", "prompt": "x", "structured_outputs": spec}).encode(),
                 completions.CompletionRequest)
    assert completions.to_job(req, job_id="j", reply_to="r", deadline_ms=1).params.constraint == job.params.constraint


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_structured_outputs_that_cannot_be_served_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat.to_job(chat_request(**fields), job_id="j", reply_to="r", deadline_ms=1)
    assert caught.value.param == param and caught.value.status == 400


def test_encrypted_reasoning_is_refused_by_name_and_a_summary_setting_accepted() -> None:
    """Databricks documents `reasoning.encrypted_content` for stateless turns; we never make any, so it is a 400
    naming it rather than something silently dropped. OVMS accepts `reasoning.summary` and ignores it: so do we."""
    with pytest.raises(InvalidRequest) as caught:
        responses.refuse_unsupported(responses_request(reasoning={"effort": "low", "encrypted_content": "gAAA"}))
    assert caught.value.param == "reasoning.encrypted_content" and caught.value.status == 400
    responses.refuse_unsupported(responses_request(reasoning={"effort": "low", "summary": "auto"}))
