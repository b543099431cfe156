"""Where the seeds' own pages (OVMS Responses 004, Databricks 003) document behaviour we used to contradict:
each example works as the page shows it, on the real engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.edge import framing
from services.edge.formats.response_render import ResponsesRenderer
from services.edge.formats.responses import ResponsesRequest
from shared.protocol.errors import WorkerLost
from tests.openapi import sse_events, validate
from tests.processes import MODEL, Edge, WorkerProcess

pytestmark = pytest.mark.engine

QUESTION = "What is the capital of France?"


async def test_ovms_responses_serve_the_sampling_extras_of_its_page(served: Edge) -> None:
    """OVMS's own extra_body example (top_k) and the rest of its list change the answer; none is ignored."""
    async with openai.AsyncOpenAI(base_url=served.url + "/v3", api_key="unused", max_retries=0) as v3:
        greedy = await v3.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20)
        top_k = await v3.responses.create(model=MODEL, input=QUESTION, temperature=1.5, max_output_tokens=20,
                                          extra_body={"top_k": 1})
        stopped = await v3.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20,
                                            extra_body={"stop": ["Paris"]})
        longer = await v3.responses.create(model=MODEL, input="Say hi.", temperature=0, max_output_tokens=30,
                                           extra_body={"ignore_eos": True})
        seeded = [await v3.responses.create(model=MODEL, input="Name a colour.", temperature=1.0,
                                            max_output_tokens=10, extra_body={"seed": 42}) for _ in range(2)]
        as_json = await v3.responses.create(model=MODEL, input="Describe Paris.", max_output_tokens=60,
                                            extra_body={"response_format": {"type": "json_object"}})
    assert top_k.output_text == greedy.output_text  # top_k 1 is greedy whatever the temperature
    assert "Paris" in greedy.output_text and "Paris" not in stopped.output_text
    assert longer.usage is not None and longer.usage.output_tokens == 30
    assert seeded[0].output_text == seeded[1].output_text
    if as_json.status == "completed":
        assert isinstance(json.loads(as_json.output_text), dict)


@pytest.mark.parametrize(("field", "value"), [("n", 2), ("best_of", 2), ("length_penalty", 0.5),
                                              ("num_assistant_tokens", 3), ("max_ngram_size", 2)])
async def test_ovms_fields_we_do_not_serve_are_refused_by_name(served: Edge, field: str, value: object) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(served.url + "/v3/responses", json={"model": MODEL, "input": "hi", field: value})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == field


async def test_v3_streams_end_with_done_and_name_cut_responses_as_ovms_does(served: Edge) -> None:
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 3, "stream": True, "tool_choice": "none"}
    ovms = await sse_events(served.url + "/v3/responses", body)
    openai_style = await sse_events(served.url + "/v1/responses", body)
    assert ovms[-1] == (None, "[DONE]") and openai_style[-1][1] != "[DONE]"
    last = ovms[-2][1]["response"]
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_tokens"}
    assert openai_style[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["tool_choice"] == "none"  # echoed as sent
    for name, data in openai_style:
        validate("ResponseStreamEvent", data)
        assert name == data["type"]


async def test_chat_template_kwargs_reach_the_template_but_not_its_own_arguments(served: Edge) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        served_kwargs = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"})
        reserved = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"add_generation_prompt": False}})
    assert served_kwargs.status_code == 200
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


def test_a_failed_response_stream_sends_an_error_event_with_type_code_and_param() -> None:
    req = ResponsesRequest(model=MODEL, input="hi", stream=True)
    renderer = ResponsesRenderer(req, response_id="resp_1", created_at=0)
    frames = framing.frames(renderer.error(WorkerLost("The worker died.")))
    events = [json.loads(frame.split(b"data: ", 1)[1]) for frame in frames]
    error = next(e for e in events if e["type"] == "error")
    assert error["code"] == "worker_lost" and error["message"] == "The worker died." and "param" in error
    validate("ResponseErrorEvent", error)
    assert events[-1]["type"] == "response.failed"


async def test_databricks_embeddings_have_an_id_and_completions_no_16_token_default(served: Edge,
                                                                                  embedder: WorkerProcess) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        embedded = await http.post(f"{served.url}/serving-endpoints/all-MiniLM-L6-v2/invocations",
                                   json={"input": ["a", "b"]})
        completed = await http.post(f"{served.url}/serving-endpoints/{MODEL}/invocations",
                                    json={"prompt": "Count from 1 to 30, separated by commas.", "temperature": 0,
                                          "stop": ["20"]})
    assert embedded.status_code == 200 and embedded.json()["id"]
    validate("CreateEmbeddingResponse", embedded.json())
    assert completed.json()["usage"]["completion_tokens"] > 16
