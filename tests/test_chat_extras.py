"""Chat Completions beyond the basics: n, logprobs, penalties, logit_bias, and the schema."""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer

from services.worker.models import default_chat_model_dir
from tests.openapi import sse_events, validate
from tests.processes import MODEL, Edge

pytestmark = pytest.mark.engine

STORY = [{"role": "user", "content": "Write a story about a cat."}]


async def test_n_choices_are_distinct_and_repeatable_with_a_seed(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "messages": STORY, "n": 3, "max_tokens": 16, "temperature": 1.0, "seed": 11}
    first = await client.chat.completions.create(**kwargs)
    second = await client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) == 3
    assert 3 <= first.usage.completion_tokens <= 3 * 16


async def test_streamed_n_interleaves_choices_and_matches_the_schema(served: Edge) -> None:
    body = {"model": MODEL, "messages": STORY, "n": 2, "max_tokens": 10, "temperature": 1.0, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    events = await sse_events(served.url + "/v1/chat/completions", body)
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _name, data in events[:-1]]
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    order = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert set(order) == {0, 1}
    assert order != sorted(order)  # the choices arrive interleaved, not one after the other
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length", "length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 20


async def test_logprobs_are_consistent_with_the_chosen_tokens(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=4)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    assert len(content) == reply.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 4
        assert token.top_logprobs[0].token == token.token  # greedy picks the likeliest
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert bytes(token.bytes or []) == token.token.encode()
        logprobs = [t.logprob for t in token.top_logprobs]
        assert logprobs == sorted(logprobs, reverse=True)


async def test_logit_bias_bans_a_token(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
              "max_tokens": 10, "temperature": 0, "logprobs": True}
    reply = await client.chat.completions.create(**kwargs)
    first = reply.choices[0].logprobs.content[0].token
    tokenizer = Tokenizer.from_file(str(default_chat_model_dir() / "tokenizer.json"))
    [first_id] = tokenizer.encode(first, add_special_tokens=False).ids
    biased = await client.chat.completions.create(**kwargs, logit_bias={str(first_id): -100})
    assert biased.choices[0].logprobs.content[0].token != first


async def test_penalties_reasoning_effort_and_user_are_accepted(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
        reasoning_effort="low", user="user-1", extra_body={"repetition_penalty": 1.3},
    )
    plain = await client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content != plain.choices[0].message.content
    assert reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


async def test_the_body_matches_the_schema(client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=STORY, max_tokens=4, n=2, temperature=0.7, logprobs=True, top_logprobs=1
    )
    validate("CreateChatCompletionResponse", raw.http_response.json())


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(129)]}, "tools"),
     ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
     ({"response_format": {"type": "json_object"}, "tool_choice": "required",  # one constraint at a time
       "tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format"),
     ({"logit_bias": {"x": 1}}, "logit_bias")],
)
async def test_what_cannot_be_honoured_is_refused_by_name(
    client: openai.AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=STORY, **extra)
    assert caught.value.body["param"] == param
