"""Chat Completions at the edge, without Redis: validation, the job it becomes, the frames it renders."""

from __future__ import annotations

import json

import pytest

from services.edge import framing
from services.edge.formats import chat
from services.edge.formats.base import decode, openai_error, unknown_fields
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, RequestTimeout

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def request(**fields: object) -> bytes:
    return json.dumps({**BASE, **fields}).encode()


def job_of(body: bytes) -> bus.Job:
    return chat.to_job(decode(body, chat.ChatCompletionRequest), job_id="j", reply_to="r", deadline_ms=1)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["x"] * 1025}, "stop"),
        ({"stop": ["a" * 1025]}, "stop[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_out_of_range_values_name_their_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        job_of(request(**fields))
    assert caught.value.param == param
    assert caught.value.status == 400


def test_missing_model_is_named() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode(b'{"messages": [{"role": "user", "content": "hi"}]}', chat.ChatCompletionRequest)
    assert caught.value.param == "model"


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b"null", b"\xff\xfe"])
def test_malformed_bodies_are_invalid_requests(body: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode(body, chat.ChatCompletionRequest)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"a": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
         "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format.json_schema.schema"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type"),
    ],
)
def test_what_we_cannot_honour_is_refused_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        job_of(request(**fields))
    assert caught.value.param == param


def test_total_stop_length_is_limited() -> None:
    with pytest.raises(InvalidRequest) as caught:
        job_of(request(stop=["a" * 1000] * 40))
    assert caught.value.param == "stop"


def test_job_carries_the_conversation_and_sampling() -> None:
    job = job_of(request(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user",
             "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
            {"role": "assistant", "content": "4"},
        ],
        temperature=0, top_p=0.5, top_k=5, max_tokens=7, stop="END", seed=3,
    ))
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4"),
    ]
    p = job.params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.seed) == (0, 0.5, 5, 7, ["END"], 3)


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert job_of(request(max_tokens=9, max_completion_tokens=4)).params.max_tokens == 4


def test_unknown_fields_are_ignored_and_found() -> None:
    body = request(frobnicate=1, temperature=1)
    assert job_of(body).params.temperature == 1
    assert unknown_fields(body, chat.ChatCompletionRequest) == ["frobnicate"]


def transcript(renderer: chat.ChatRenderer, events: list[bus.Tokens | bus.Final]) -> list[object]:
    payloads = [payload for event in events for payload in renderer.render(event)] + renderer.done()
    frames = framing.frames(payloads)
    return [payload_of(f) for f in frames]


def payload_of(frame: bytes) -> object:
    """The JSON of one `data:` frame, or "[DONE]"."""
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    data = frame[len(b"data: "):-2]
    return "[DONE]" if data == b"[DONE]" else json.loads(data)


EVENTS: list[bus.Tokens | bus.Final] = [
    bus.Tokens(job="j", text="Hel", token_ids=[1]),
    bus.Tokens(job="j", text="lo", token_ids=[2, 3], finish_reason="length"),
    bus.Final(job="j", prompt_tokens=4, completion_tokens=3),
]


def test_stream_transcript_with_usage() -> None:
    req = decode(request(stream=True, stream_options={"include_usage": True}), chat.ChatCompletionRequest)
    frames = transcript(chat.ChatRenderer(req, response_id="chatcmpl-1", created=7), EVENTS)
    common = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}

    def chunk(delta: dict[str, str], finish: str | None = None) -> dict[str, object]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**common, "choices": [choice], "usage": None}

    assert frames == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "length"),
        {**common, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                            "completion_tokens_details": {"reasoning_tokens": 0}}},
        "[DONE]",
    ]


def test_content_chunks_escape_text_and_keep_their_choice() -> None:
    req = decode(request(stream=True, n=2), chat.ChatCompletionRequest)
    renderer = chat.ChatRenderer(req, response_id="c", created=1)
    texts = ['say "hi"\n', "\\ caf\u00e9 \u2603 \x01", "</script>"]
    contents = []
    for i, text in enumerate(texts):
        for frame in framing.frames(renderer.render(bus.Tokens(job="j", text=text, token_ids=[i], choice=i % 2))):
            chunk = payload_of(frame)
            assert isinstance(chunk, dict)
            if chunk["choices"][0]["delta"].get("content"):
                contents.append(chunk["choices"])
    assert contents == [[{"index": i % 2, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
                        for i, text in enumerate(texts)]


def test_stream_without_usage_has_no_usage_field() -> None:
    req = decode(request(stream=True), chat.ChatCompletionRequest)
    frames = transcript(chat.ChatRenderer(req, response_id="c", created=1), EVENTS)
    assert all("usage" not in f for f in frames if isinstance(f, dict))
    assert len(frames) == 5


def test_body_aggregates_the_same_events() -> None:
    req = decode(request(), chat.ChatCompletionRequest)
    renderer = chat.ChatRenderer(req, response_id="c", created=1)
    for event in EVENTS:
        renderer.render(event)
    body = json.loads(framing.body(renderer.body()))
    assert body["object"] == "chat.completion"
    message = {"role": "assistant", "content": "Hello", "refusal": None}
    assert body["choices"] == [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "completion_tokens_details": {"reasoning_tokens": 0}}


def test_error_after_the_stream_began_is_an_error_frame_then_done() -> None:
    req = decode(request(stream=True), chat.ChatCompletionRequest)
    renderer = chat.ChatRenderer(req, response_id="c", created=1)
    frames = [payload_of(f) for f in framing.frames(renderer.error(RequestTimeout("late")))]
    assert frames[0] == {"error": {"message": "late", "type": "timeout_error", "param": None,
                                               "code": None}}
    assert frames[1] == "[DONE]"


def test_openai_error_shape() -> None:
    error = InvalidRequest("bad", param="temperature")
    assert json.loads(openai_error(error)) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": None}
    }
