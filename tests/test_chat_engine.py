"""Chat Completions through the whole path: openai SDK -> edge -> Redis -> vLLM worker -> SSE."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest

from tests.processes import MODEL, Edge, WorkerProcess, metric_value, start_edge, stop_process

pytestmark = pytest.mark.engine

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


async def stream_chat(client: openai.AsyncOpenAI, **kwargs: object) -> tuple[str, list[object]]:
    chunks = [chunk async for chunk in await client.chat.completions.create(stream=True, **kwargs)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


async def test_greedy_answer_says_paris(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL
    assert abs(reply.created - time.time()) < 60
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.role == "assistant"


async def test_streamed_and_unstreamed_greedy_outputs_are_identical(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "messages": STORY, "temperature": 0, "max_tokens": 60}
    whole = await client.chat.completions.create(**kwargs)
    streamed, chunks = await stream_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


async def test_usage_adds_up(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    usage = reply.usage
    assert usage is not None
    assert usage.prompt_tokens > 10  # the chat template's system prompt and the question
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_max_tokens_ends_with_length(client: openai.AsyncOpenAI, stream: bool) -> None:
    kwargs = {"model": MODEL, "messages": STORY, "max_tokens": 7, "temperature": 0}
    if stream:
        _text, chunks = await stream_chat(client, stream_options={"include_usage": True}, **kwargs)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        assert chunks[-1].usage.completion_tokens == 7
    else:
        reply = await client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 7


async def test_stop_sequence_ends_the_answer_before_it(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=[" Paris"])
    text = reply.choices[0].message.content or ""
    assert "Paris" not in text
    assert text.startswith("The capital of France is")
    assert reply.choices[0].finish_reason == "stop"


async def test_text_parts_mean_the_same_as_a_string(client: openai.AsyncOpenAI) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "You answer in one sentence."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "system", "content": "You answer in one sentence."},
             {"role": "user", "content": "What is the capital of France?"}]
    a = await client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=20)
    b = await client.chat.completions.create(model=MODEL, messages=plain, temperature=0, max_tokens=20)
    assert a.choices[0].message.content == b.choices[0].message.content


async def test_a_seed_makes_sampling_repeatable(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "messages": STORY, "temperature": 1.0, "top_p": 0.95,
              "extra_body": {"top_k": 50}, "max_tokens": 30, "seed": 1234}
    first = await client.chat.completions.create(**kwargs)
    second = await client.chat.completions.create(**kwargs)
    other = await client.chat.completions.create(**{**kwargs, "seed": 99})
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content


async def test_top_p_zero_keeps_the_most_likely_token_alone(client: openai.AsyncOpenAI) -> None:
    """OpenAI allows top_p 0 (vLLM takes only more): the answer is the greedy one, whatever the temperature."""
    greedy = await client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=20)
    for seed in (1, 2):
        nucleus = await client.chat.completions.create(model=MODEL, messages=STORY, temperature=1.5, top_p=0,
                                                       max_tokens=20, seed=seed)
        assert nucleus.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop[0]"),
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
async def test_bad_input_is_a_400_in_openai_shape(
    client: openai.AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=FRANCE, **extra)
    assert time.monotonic() - started < 1.0
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


async def test_unknown_model_is_a_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="no-such-model", messages=FRANCE)
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body", [b"{not json", b"", b"[]"])
async def test_malformed_json_is_a_400(served: Edge, body: bytes) -> None:
    async with httpx.AsyncClient() as http:
        reply = await http.post(served.url + "/v1/chat/completions", content=body,
                                headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_longer_than_the_context_is_a_400_even_when_streaming(
    client: openai.AsyncOpenAI, stream: bool
) -> None:
    long_prompt = "tell me about the sea " * 600  # about 3,000 tokens against a 2,048-token context
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}], stream=stream
        )
    assert caught.value.status_code == 400
    assert caught.value.body["code"] == "context_length_exceeded"
    assert caught.value.body["param"] == "messages"


async def _aborts(worker: WorkerProcess) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(worker.metrics_url)).text
    return metric_value(text, "tokenbus_worker_engine_aborts_total")


async def test_a_disconnect_aborts_the_engine_request_within_a_second(served: Edge, worker: WorkerProcess) -> None:
    before = await _aborts(worker)
    body = {"model": MODEL, "messages": STORY, "stream": True, "max_tokens": 1500, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(served.url + "/v1/chat/completions", json=body)
        assert response.status == 200
        frames = 0
        async for line in response.content:
            frames += line.startswith(b"data: ")
            if frames >= 5:
                break
        response.connection.transport.abort()  # the client vanishes
        gone = time.monotonic()
        response.release()
    while await _aborts(worker) == before:
        assert time.monotonic() - gone < 1.0, "the engine did not abort within 1 s"
        await asyncio.sleep(0.02)


async def test_a_stream_stopped_while_its_constraint_compiles_never_reaches_the_engine(
        served: Edge, worker: WorkerProcess) -> None:
    """Stop means stop before the engine too: a schema new to the worker, one `maxLength` (~1.4 s of CPU for the
    grammar gate to compile here), and the client gone while the worker compiles it (before any answer). The job
    ends aborted once the compile is done, and the engine never prefills its prompt (it did, then stopped at the
    first token)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200 + uuid.uuid4().int % 10_000}}}

    async def metric(name: str, labels: dict[str, str] | None = None) -> float:
        async with httpx.AsyncClient() as http:
            return metric_value((await http.get(worker.metrics_url)).text, name, labels)

    prompted, aborted = await metric("vllm:prompt_tokens_total"), await metric("tokenbus_worker_jobs_total",
                                                                              {"outcome": "aborted"})
    body = {"model": MODEL, "messages": STORY, "stream": True, "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    async with aiohttp.ClientSession() as session:
        asking = asyncio.create_task(session.post(served.url + "/v1/chat/completions", json=body))
        deadline = time.monotonic() + 10
        while await metric("tokenbus_worker_running_jobs") < 1:  # taken up: on its way to the engine, compiling
            assert time.monotonic() < deadline and not asking.done()
            await asyncio.sleep(0.02)
        asking.cancel()  # the client vanishes before its stream opened (that takes the first token)
        with contextlib.suppress(asyncio.CancelledError):
            await asking
    deadline = time.monotonic() + 30
    while await metric("tokenbus_worker_jobs_total", {"outcome": "aborted"}) == aborted:
        assert time.monotonic() < deadline, "the job did not end aborted"
        await asyncio.sleep(0.1)
    assert await metric("vllm:prompt_tokens_total") == prompted


async def test_closing_a_plain_sdk_stream_stops_the_engine_within_a_second_even_with_a_resume_window(
    served: Edge, worker: WorkerProcess, redis_url: str, tmp_path: Path
) -> None:
    """Stop means stop: the SDK asked for no event ids, so its job is not kept for a resume it cannot make."""
    edge = start_edge(redis_url, tmp_path, resume_window_s=10)
    try:
        before = await _aborts(worker)
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
            stream = await client.chat.completions.create(model=MODEL, messages=STORY, stream=True,
                                                          max_tokens=1500, extra_body={"ignore_eos": True})
            chunks = 0
            async for _chunk in stream:
                chunks += 1
                if chunks >= 5:
                    break
            await stream.close()  # the user pressed Stop
            gone = time.monotonic()
        while await _aborts(worker) == before:
            assert time.monotonic() - gone < 1.0, "the engine did not abort within 1 s"
            await asyncio.sleep(0.02)
    finally:
        stop_process(edge.process)


async def test_two_concurrent_streams_both_finish(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "max_tokens": 40, "temperature": 0}
    (a, a_chunks), (b, b_chunks) = await asyncio.gather(
        stream_chat(client, messages=FRANCE, **kwargs), stream_chat(client, messages=STORY, **kwargs)
    )
    assert "Paris" in a
    assert len(b) > 20
    for chunks in (a_chunks, b_chunks):
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
