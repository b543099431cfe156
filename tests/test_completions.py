"""OpenAI Completions through the whole path, checked with the openai SDK and the OpenAI schema."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from services.worker.models import default_chat_model_dir
from tests.openapi import sse_events, validate
from tests.processes import GATHERING_MODEL, MODEL, Edge, WorkerProcess

pytestmark = pytest.mark.engine

PARIS = "The capital of France is"


def validate_chunk(chunk: dict[str, Any]) -> None:
    """The schema has no chunk type for completions: a chunk is a CreateCompletionResponse whose
    finish_reason is null until its choice ends (as OpenAI and vLLM send it), which the schema cannot say."""
    assert all(set(c) == {"text", "index", "logprobs", "finish_reason"} for c in chunk["choices"])
    validate("CreateCompletionResponse", {**chunk, "choices": [c for c in chunk["choices"] if c["finish_reason"]]})


async def test_batch_with_n_gives_choices_per_prompt_in_order(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(
        model=MODEL, prompt=[PARIS, "Once upon a time"], n=2, max_tokens=8, temperature=1.0, seed=7
    )
    assert reply.object == "text_completion"
    assert reply.id.startswith("cmpl-")
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert all(c.text for c in reply.choices)
    assert reply.usage is not None
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.completion_tokens <= 4 * 8
    # the two choices of each prompt were sampled independently
    assert reply.choices[0].text != reply.choices[1].text or reply.choices[2].text != reply.choices[3].text


async def test_greedy_n_gives_n_choices_of_the_one_answer(client: openai.AsyncOpenAI) -> None:
    """OpenAI takes n > 1 at temperature 0 (vLLM refuses it): every choice is the greedy answer, each counted."""
    one = await client.completions.create(model=MODEL, prompt=[PARIS, "Once upon a time"], max_tokens=8,
                                          temperature=0, logprobs=1)
    three = await client.completions.create(model=MODEL, prompt=[PARIS, "Once upon a time"], n=3, max_tokens=8,
                                            temperature=0, logprobs=1)
    assert [c.index for c in three.choices] == list(range(6))
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3 + [one.choices[1].text] * 3
    assert three.choices[3].logprobs == three.choices[4].logprobs == three.choices[5].logprobs  # one sequence
    assert three.choices[4].logprobs is not None and one.choices[1].logprobs is not None
    assert three.choices[4].logprobs.tokens == one.choices[1].logprobs.tokens  # (their last digits vary by batch)
    assert one.usage is not None and three.usage is not None
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    streamed = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PARIS}],
                                                    n=2, max_tokens=8, temperature=0, stream=True)
    texts = ["", ""]
    async for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] != ""


async def test_a_seed_repeats_n_distinct_choices(client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "n": 3, "max_tokens": 12, "temperature": 1.0,
              "seed": 42}
    first = await client.completions.create(**kwargs)
    second = await client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) == 3


async def test_greedy_default_is_16_tokens_and_mentions_paris(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model=MODEL, prompt=PARIS, temperature=0, extra_body={"ignore_eos": True})
    assert "Paris" in reply.choices[0].text
    assert reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


async def test_echo_and_suffix_surround_the_completion(client: openai.AsyncOpenAI) -> None:
    plain = await client.completions.create(model=MODEL, prompt=PARIS, max_tokens=6, temperature=0)
    framed = await client.completions.create(model=MODEL, prompt=PARIS, max_tokens=6, temperature=0, echo=True,
                                             suffix=" [end]")
    assert framed.choices[0].text == PARIS + plain.choices[0].text + " [end]"


async def test_streamed_echo_and_suffix_match_the_whole(served: Edge, client: openai.AsyncOpenAI) -> None:
    body = {"model": MODEL, "prompt": [PARIS, "One, two,"], "max_tokens": 6, "temperature": 0, "echo": True,
            "suffix": "!", "stream": True, "stream_options": {"include_usage": True}}
    events = await sse_events(served.url + "/v1/completions", body)
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _name, data in events[:-1]]
    for chunk in chunks:
        validate_chunk(chunk)
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    whole = await client.completions.create(**{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True)


async def test_logprobs_follow_the_chosen_tokens(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model=MODEL, prompt=PARIS, max_tokens=6, temperature=0, logprobs=3)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == reply.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert logprob <= 0
        # greedy: the chosen token is the likeliest one
        assert max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


async def test_echo_with_logprobs_scores_the_prompt_too(client: openai.AsyncOpenAI,
                                                        gathering_worker: WorkerProcess) -> None:
    """On a model served without LoRA adapters (MODEL's worker serves them: see the next test)."""
    reply = await client.completions.create(model=GATHERING_MODEL, prompt=PARIS, max_tokens=3, temperature=0,
                                            logprobs=1, echo=True)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert reply.choices[0].text.startswith(PARIS)
    prompt_len = reply.usage.prompt_tokens
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 and not math.isnan(v) for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == prompt_len + reply.usage.completion_tokens


async def test_a_model_served_with_adapters_refuses_to_score_prompts_and_echoes_them(
        client: openai.AsyncOpenAI) -> None:
    """vLLM fails its engine core computing a prompt's logprobs with LoRA enabled (vLLM issues 29955, 16668): one
    tenant's echo with logprobs would end every tenant's streams on that worker. Refused, in OpenAI's shape; an
    echo alone (of text, or of token ids) is served."""
    for prompt in (PARIS, [PARIS, "One, two,"]):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=0, echo=True)
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == "logprobs", body
        assert body["code"] == "prompt_logprobs_unavailable" and MODEL in body["message"]
    echoed = await client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PARIS) and echoed.choices[0].logprobs is None
    scored_answer = await client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2, logprobs=1)
    assert scored_answer.choices[0].logprobs is not None and scored_answer.usage is not None
    assert len(scored_answer.choices[0].logprobs.tokens or []) == scored_answer.usage.completion_tokens  # served


async def test_a_prompt_of_token_ids_runs_as_its_text_does_and_echoes_it(client: openai.AsyncOpenAI,
                                                                      gathering_worker: WorkerProcess) -> None:
    """OpenAI's and vLLM's prompt as token ids (what evaluation harnesses send, with echo and logprobs to score a
    continuation): the same answer as its text's, its text echoed, its tokens scored and counted exactly."""
    ids = AutoTokenizer.from_pretrained(default_chat_model_dir()).encode(PARIS)
    as_text = await client.completions.create(model=MODEL, prompt=PARIS, max_tokens=6, temperature=0)
    as_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(ids)
    scored = await client.completions.create(model=GATHERING_MODEL, prompt=[ids, ids[:3]], max_tokens=1,
                                             temperature=0, logprobs=1, echo=True)  # no adapters: it scores prompts
    first = scored.choices[0]
    assert first.text.startswith(PARIS) and scored.choices[1].text.startswith(PARIS[:5])
    assert first.logprobs is not None and "".join(first.logprobs.tokens) == first.text
    assert len(first.logprobs.tokens) == len(ids) + 1 and first.logprobs.token_logprobs[0] is None
    echoed = await client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PARIS) and echoed.choices[0].logprobs is None
    for prompt, param, code in [([ids, "text"], "prompt", None), ([10**9], "prompt", None),
                                (ids * 500, "prompt", "context_length_exceeded")]:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert caught.value.body["param"] == param and caught.value.body["code"] == code, caught.value.body


async def test_tokenize_and_detokenize_as_vllm_and_tgi_serve_them(served: Edge, client: openai.AsyncOpenAI) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize, and TGI's /tokenize
    (each token with its span): the model's own tokenizer's ids, the counts its answers report."""
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    ids = tokenizer.encode(PARIS)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    ran = await client.chat.completions.create(model=MODEL, messages=ask, max_tokens=1)
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        prompt = (await http.post("/tokenize", json={"model": MODEL, "prompt": PARIS, "return_token_strs": True}))
        chat = (await http.post("/tokenize", json={"model": MODEL, "messages": ask})).json()
        text = (await http.post("/detokenize", json={"model": MODEL, "tokens": ids})).json()
        tgi = (await http.post("/tokenize", json={"inputs": PARIS})).json()
        unknown = await http.post("/detokenize", json={"tokens": [10**9]})
        beyond = await http.post("/detokenize", json={"tokens": ids * 600})  # more than the 2048-token context
        too_long = await http.post("/tokenize", json={"prompt": PARIS * 600})
    assert prompt.status_code == 200 and prompt.json() == {
        "count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert ran.usage is not None and chat["count"] == ran.usage.prompt_tokens == len(chat["tokens"])
    assert text == {"prompt": PARIS}
    assert [token["id"] for token in tgi] == ids
    assert all(PARIS[token["start"]:token["stop"]] == token["text"] for token in tgi)
    assert "".join(token["text"] for token in tgi).replace(" ", "") == PARIS.replace(" ", "")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tokens"
    assert beyond.status_code == 400 and beyond.json()["error"]["param"] == "tokens"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


async def test_use_raw_prompt_false_applies_the_chat_template(client: openai.AsyncOpenAI) -> None:
    raw = await client.completions.create(model=MODEL, prompt="What is the capital of France?", max_tokens=12,
                                          temperature=0)
    templated = await client.completions.create(model=MODEL, prompt="What is the capital of France?", max_tokens=12,
                                                temperature=0, extra_body={"use_raw_prompt": False})
    assert templated.usage.prompt_tokens > raw.usage.prompt_tokens + 10
    assert "Paris" in templated.choices[0].text


async def test_error_behavior_chooses_between_a_400_and_what_fits(client: openai.AsyncOpenAI) -> None:
    long_prompt = "the sea is deep and " * 500  # about 2,500 tokens against a 2,048-token context
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert caught.value.body["param"] == "prompt"
    fitted = await client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0,
                                             extra_body={"error_behavior": "truncate", "ignore_eos": True})
    assert fitted.usage.completion_tokens == 8
    assert fitted.usage.prompt_tokens + 8 <= 2048


async def test_the_body_matches_the_schema(client: openai.AsyncOpenAI) -> None:
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt=PARIS, max_tokens=4, logprobs=2)
    validate("CreateCompletionResponse", raw.http_response.json())


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"logprobs": 21}, "logprobs"),
     ({"best_of": 3}, "best_of"), ({"extra_body": {"error_behavior": "ignore"}}, "error_behavior")],
)
async def test_bad_completion_input_is_a_400(client: openai.AsyncOpenAI, extra: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(**{"model": MODEL, "prompt": PARIS, **extra})
    assert caught.value.body["param"] == param
