"""Structured outputs on the real engine: the official SDKs' parse helpers, JSON schemas that every answer
validates against (sampled at temperature 1.0, several seeds, streamed and not), JSON objects, and TGI
grammars. A 135M model does not write valid JSON by itself: only the engine's constraint makes these pass."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel

from tests.openapi import validate
from tests.processes import GATHERING_MODEL, MODEL, Edge, WorkerProcess

pytestmark = pytest.mark.engine

SEEDS = (1, 2, 3)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


class City(BaseModel):
    name: str
    country: str


async def test_chat_parse_gives_a_parsed_object(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City, max_tokens=60, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_answers_validate_at_temperature_one(client: openai.AsyncOpenAI, stream: bool) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in SEEDS:
        if stream:
            chunks = await client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format,
                                                          temperature=1.0, seed=seed, max_tokens=80, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=ASK, response_format=response_format, temperature=1.0, seed=seed, max_tokens=80)
            body = raw.http_response.json()
            validate("CreateChatCompletionResponse", body)
            text = body["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), PERSON)


async def test_a_tgi_json_schema_grammar_holds_answers_to_its_schema(served: Edge) -> None:
    """TGI's `json_schema` grammar names its schema ({"name", "schema"}): answers validate against `schema`."""
    client = InferenceClient(base_url=served.url, timeout=60)
    for seed in SEEDS:
        text = await asyncio.to_thread(
            client.text_generation, "Describe a person as JSON:", max_new_tokens=80, temperature=1.0, seed=seed,
            grammar={"type": "json_schema", "value": {"name": "person", "schema": PERSON}})
        jsonschema.validate(json.loads(text), PERSON)
    async with httpx.AsyncClient(timeout=30) as http:
        unnamed = await http.post(served.url + "/generate", json={"inputs": "Say:", "parameters": {
            "grammar": {"type": "json_schema", "value": PERSON}}})
    assert unnamed.status_code == 422 and unnamed.json()["error_type"] == "validation"
    assert "schema" in unnamed.json()["error"]


async def test_json_object_answers_parse(client: openai.AsyncOpenAI) -> None:
    for seed in SEEDS:
        answer = await client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=seed,
                                                      response_format={"type": "json_object"}, max_tokens=60)
        if answer.choices[0].finish_reason == "stop":  # a cut answer cannot close its object
            assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


async def test_responses_parse_gives_a_parsed_object(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.parse(model=MODEL, input="Which city is the capital of Italy?",
                                            text_format=City, max_output_tokens=60, temperature=0)
    assert isinstance(response.output_parsed, City)
    dumped = response.model_dump(exclude_none=True)
    assert dumped["text"]["format"]["type"] == "json_schema" and dumped["text"]["format"]["name"] == "City"


async def test_a_schema_that_is_not_one_is_a_400_naming_it(served: Edge) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "response_format": {
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}})
        regex = await http.post(served.url + "/generate", json={
            "inputs": "Phone:", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_format.json_schema.schema"
    assert regex.status_code == 422 and "regular expression" in regex.json()["error"]


async def test_a_grammar_the_engine_cannot_compile_is_the_callers_error_and_the_edge_serves_on(
        served: Edge) -> None:
    """A backreference is a valid Python regular expression (the edge's check passes it) that vLLM's grammar
    backends refuse: the refusal is the caller's 400 / 422, in each API's shape, not the engine failing."""
    await _refused_by_the_engine(served, {"structured_outputs": {"regex": "(a)\\1"}},
                                 {"type": "regex", "value": "(a)\\1"})


async def _refused_by_the_engine(served: Edge, chat_constraint: dict[str, object],
                                 tgi_grammar: dict[str, object]) -> None:
    """The constraint is the caller's 400 on Chat and 422 on TGI, each in its API's shape, and the engine serves
    the next request."""
    async with httpx.AsyncClient(timeout=60) as http:
        chat = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 8, **chat_constraint})
        tgi = await http.post(served.url + "/generate", json={
            "inputs": "Say:", "parameters": {"max_new_tokens": 8, "grammar": tgi_grammar}})
        after = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 4})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "invalid_structured_output"
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation", tgi.text
    assert after.status_code == 200


async def test_an_array_xgrammar_cannot_take_is_served_within_the_items_bound_and_refused_past_it(
        served: Edge) -> None:
    """An array without `items` goes to vLLM's llguidance fallback, which counts out every item on the worker's
    loop: one `minItems` of 10^8 held it 18 s, and the edges took the worker for dead. Within the bound the edge
    takes it; past it the edge refuses, and the engine serves on."""
    def asking(schema: dict[str, object]) -> dict[str, object]:
        return {"model": MODEL, "messages": ASK, "max_tokens": 16, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": schema}}}

    async with httpx.AsyncClient(timeout=60) as http:
        within = await http.post(served.url + "/v1/chat/completions",
                                 json=asking({"type": "array", "minItems": 1, "maxItems": 9_000}))
        past = await http.post(served.url + "/v1/chat/completions",
                               json=asking({"type": "array", "minItems": 1, "maxItems": 300_000}))
        after = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 4})
    # The edge takes it. vLLM's engine compiles every constraint with the backend its first one chose, so once an
    # XGrammar one ran, this fallback one fails to compile there: the engine's 400, not the edge's bound.
    if within.status_code != 200:
        assert within.json()["error"]["code"] == "invalid_structured_output", within.text
        assert "array items" not in within.text
    assert past.status_code == 400, past.text
    assert past.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "array items" in past.json()["error"]["message"]
    assert after.status_code == 200


async def test_a_constraint_the_engine_fails_to_compile_is_an_error_not_an_empty_answer(served: Edge) -> None:
    """XGrammar (as deploy/locks pins it) passes this schema at vLLM's check, then fails to compile it in the
    engine ("Check failed"): vLLM finishes the request with reason `error`, which read as an empty answer that
    had stopped (200). It is the caller's 400 / 422, and the engine serves on."""
    schema = {"type": "object", "required": [f"p{i}" for i in range(10)],
              "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{1000 + i}}}$"} for i in range(10)}}
    await _refused_by_the_engine(
        served, {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
        {"type": "json", "value": schema})


async def test_a_constraint_too_slow_to_compile_is_refused_in_time_and_others_are_served_beside_it(
        served: Edge) -> None:
    """40 strings of distinct bounded lengths: XGrammar's compile costs ~1.4 s of CPU time for each here. vLLM's
    engine compiled it with no deadline (12 s on this machine's cores), every other constrained request waiting,
    then served it (200). The worker compiles it first in its helper, refuses it past --grammar-compile-s (5 s of
    each core: 10 s of CPU time), and the engine never sees it. Another schema beside it is served (this edge has no
    keys: one tenant, whose constraints compile one at a time; another tenant's would not wait, see
    tests/test_grammar_gate.py and docs/sweeps/slow_grammar.py)."""
    strings: dict[str, object] = {f"p{i}": {"type": "string", "maxLength": 3000 + i} for i in range(40)}
    slow = {"type": "object", "properties": strings}
    chat_slow = {"model": MODEL, "messages": ASK, "max_tokens": 8,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow}}}
    # `multipleOf` sends it to vLLM's llguidance fallback at its check, but the engine compiles it with the backend
    # its first constraint chose, XGrammar (which ignores `multipleOf`): as slowly
    fallback = {"type": "object", "properties": {**strings, "n": {"type": "integer", "multipleOf": 3}}}
    tgi_slow = {"inputs": "Say:", "parameters": {"max_new_tokens": 8, "grammar": {"type": "json", "value": fallback}}}
    async with httpx.AsyncClient(timeout=120) as http:
        started = asyncio.get_running_loop().time()
        refused = asyncio.gather(http.post(served.url + "/v1/chat/completions", json=chat_slow),
                                 http.post(served.url + "/generate", json=tgi_slow))
        await asyncio.sleep(0.5)
        beside = await http.post(served.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
        chat, tgi = await refused
        took = asyncio.get_running_loop().time() - started
    assert beside.status_code == 200 and '"finish_reason"' in beside.text, beside.text
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "invalid_structured_output"
    assert "too long to compile" in chat.json()["error"]["message"]
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation", tgi.text
    assert took < 90, took  # 13 s on an idle machine: 10 s of CPU for the niced helper, then a new one; 25 s in CI


async def test_a_workers_first_constraint_does_not_decide_how_it_serves_every_other(
        served: Edge, gathering_worker: WorkerProcess) -> None:
    """vLLM's engine takes one structured-output backend, the one its first constrained request was given, and its
    check gives a schema with `multipleOf` llguidance. On a fresh worker whose first constraint was such a schema
    (one tenant's request), every later one was compiled with llguidance: a structural tag was a 400 there and a 200
    on every other worker. The worker now makes XGrammar the backend before it serves. The gathering worker sees no
    other constraint than these (keep it so: the test needs its first)."""
    multiple = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}, "required": ["n"]}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<person>", "end": "</person>",
                                                "content": {"type": "json_schema", "json_schema": PERSON}}}
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
        first = await http.post("/v1/chat/completions", json={
            "model": GATHERING_MODEL, "messages": ASK, "max_tokens": 12,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": multiple}}})
        tagged = await http.post("/v1/chat/completions", json={
            "model": GATHERING_MODEL, "messages": ASK, "response_format": tag, "max_tokens": 80, "temperature": 0})
    assert first.status_code == 200, first.text
    assert tagged.status_code == 200, tagged.text
    assert re.fullmatch(r"<person>(.*)</person>", tagged.json()["choices"][0]["message"]["content"], re.DOTALL)


def test_tgi_grammars_shape_the_text(served: Edge) -> None:
    hf = InferenceClient(model=served.url, timeout=60)
    phone = hf.text_generation("My phone number is", max_new_tokens=20, seed=7, temperature=1.0,
                               grammar={"type": "regex", "value": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone)
    person = hf.text_generation("A person:", max_new_tokens=80, seed=7, temperature=1.0,
                                grammar={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(person), PERSON)


async def test_an_xgrammar_structural_tag_holds_the_tagged_text_to_its_schema(served: Edge) -> None:
    """OVMS's "XGrammar structural tags format" of `response_format`: a tag whose content is held to a schema
    (xgrammar's `format` form forces the tag itself); the `structures` and `triggers` form compiles too, and a
    structure that no trigger opens is a 400 naming it."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<person>", "end": "</person>",
                                                "content": {"type": "json_schema", "json_schema": PERSON}}}
    legacy = {"type": "structural_tag", "triggers": ["<function="],
              "structures": [{"begin": "<function=describe>", "schema": PERSON, "end": "</function>"}]}
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        forced = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "response_format": tag, "max_tokens": 80, "temperature": 1.0,
            "seed": 3})
        free = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "response_format": legacy, "max_tokens": 10})
        stray = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "response_format": {**legacy, "triggers": ["<tool>"]}})
    assert forced.status_code == 200, forced.text
    body = forced.json()
    validate("CreateChatCompletionResponse", body)
    found = re.fullmatch(r"<person>(.*)</person>", body["choices"][0]["message"]["content"], re.DOTALL)
    assert found, body["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(found.group(1)), PERSON)
    assert free.status_code == 200, free.text
    assert stray.status_code == 400 and stray.json()["error"]["param"] == "response_format.structures[0].begin"
