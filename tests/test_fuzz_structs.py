"""Hypothesis over the request structs: whatever a client sends, decoding it and building its job (as far as
the bus) succeeds or fails with a 4xx error, never with another exception (which the edge answers with a 500)."""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.edge.formats import (
    chat,
    completions,
    embeddings,
    messages,
    planners,
    rerank,
    responses,
    tgi,
)
from services.edge.store import Conversation
from shared.protocol import bus
from shared.protocol.errors import TokenbusError

MAX_MODEL_LEN = 2048
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _answer(need: planners.Need) -> object:
    """What the edge would answer a planner: a worker of the model, no earlier turns, room to store, an arrival."""
    if isinstance(need, planners.Model):
        return bus.WorkerInfo(worker="w", model=need.name, task=need.task, max_model_len=MAX_MODEL_LEN,
                              dimensions=384, features=[*bus.WORKER_FEATURES, bus.PROMPT_SCORES])
    if isinstance(need, planners.ServedModel):
        return "m"
    if isinstance(need, planners.PreviousTurns):
        return Conversation()
    if isinstance(need, planners.Arrive):
        return planners.Arrival(job_id="job-1", started=0.0, deadline_ms=1, reply_to="tokenbus:events:{edge}",
                                created=0, seed=need.seed)
    return None


def planned(plan: Callable[[bytes], planners.Planning]) -> Callable[[bytes], bus.Job]:
    """The edge's own planner (services.edge.formats.planners), driven with `_answer`'s answers."""
    def build(body: bytes) -> bus.Job:
        planning = plan(body)
        step = planners.advance(planning)
        while not isinstance(step, planners.Planned):
            step = planners.advance(planning, _answer(step))
        return step.job
    return build


@dataclass(frozen=True)
class Format:
    kind: type[msgspec.Struct]
    example: dict[str, Any]
    """A valid body, which the fuzzers change field by field."""
    build: Callable[[bytes], bus.Job]
    """What the edge does with a body before the job goes on the bus."""


FORMATS = {
    "chat": Format(chat.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
                   planned(planners.plan_chat)),
    "completions": Format(completions.CompletionRequest, {"model": "m", "prompt": "Once"},
                          planned(planners.plan_completions)),
    "responses": Format(responses.ResponsesRequest, {"model": "m", "input": "Hi"}, planned(planners.plan_responses)),
    "embeddings": Format(embeddings.EmbeddingRequest, {"model": "m", "input": "Hi"},
                         planned(planners.plan_embeddings)),
    "tgi": Format(tgi.GenerateRequest, {"inputs": "Hi", "parameters": {"max_new_tokens": 4}},
                  planned(functools.partial(planners.plan_tgi, stream=None))),
    "messages": Format(messages.MessagesRequest, {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, planned(planners.plan_messages)),
    "rerank": Format(rerank.RerankRequest, {"model": "m", "query": "q", "documents": ["a", {"text": "b"}]},
                     planned(planners.plan_rerank)),
    "score": Format(rerank.ScoreRequest, {"model": "m", "text_1": "q", "text_2": ["a", "b"]},
                    planned(planners.plan_score)),
    "count_tokens": Format(messages.CountTokensRequest, {"model": "m", "messages": [
        {"role": "user", "content": "Hi"}]}, planned(planners.plan_count_tokens)),
    "input_tokens": Format(responses.InputTokensRequest, {"model": "m", "input": "Hi"},
                           planned(planners.plan_response_input_tokens)),
}

# values at the edges of what the structs' types hold: 64-bit and 32-bit limits, huge, negative, odd text
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**80, 10**15])
ODD_TEXT = st.sampled_from(["", "\ud800", "\udfff", "²", "١٢", "9" * 30, "None", "text", "\x00", "ü" * 3])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), EDGE_INTS,
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12), ODD_TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6) | ODD_TEXT, inner, max_size=3), max_leaves=12)


TYPED: dict[type, st.SearchStrategy[Any]] = {
    int: st.integers() | EDGE_INTS,
    float: st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e308, -1e308, 5e-324, -100.0, 100.5]),
    str: st.text(max_size=12) | ODD_TEXT,
    bool: st.booleans(),
    dict: st.dictionaries(st.text(max_size=6) | ODD_TEXT | st.integers(0, 10**12).map(str),
                          st.integers(-200, 200) | SCALARS, max_size=3),
}


def _kinds(annotation: Any, in_list: bool = False) -> list[tuple[Any, bool]]:
    """The plain types and request structs a field's annotation admits (each with whether it comes as a
    list of them), through unions, Annotated and Literal."""
    if isinstance(annotation, type):
        return [(annotation, in_list)]
    if not (args := typing.get_args(annotation)):
        return [(type(annotation), in_list)]  # a Literal's value
    if typing.get_origin(annotation) is typing.Annotated:
        return _kinds(args[0], in_list)
    if typing.get_origin(annotation) is list:
        return _kinds(args[0], True)
    return [kind for arg in args for kind in _kinds(arg, in_list)]


def _values(annotation: Any, depth: int) -> st.SearchStrategy[Any]:
    """Values of the field's own types at their edges (nested structs changed field by field), or any JSON."""
    options = [JSON]
    for kind, in_list in _kinds(annotation):
        if issubclass(kind, msgspec.Struct):
            if depth < 2:
                nested = _struct_bodies(kind, {}, depth + 1)
                options.append(st.lists(nested, min_size=1, max_size=2) if in_list else nested)
        elif kind in TYPED:
            options.append(st.lists(TYPED[kind], max_size=3) if in_list else TYPED[kind])
    return st.one_of(options)


def _struct_bodies(kind: type[msgspec.Struct], example: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Bodies that start from `example` and change one to three of its fields (nested structs' too): few
    enough that the rest stays valid and the change reaches the job."""
    hints = typing.get_type_hints(kind, include_extras=True)
    fields = list(kind.__struct_fields__)
    changes = st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: _values(hints[name], depth) for name in names}))
    return changes.map(lambda changed: {**example, **changed})


def _encoded(value: Any, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate goes out as bytes that are not UTF-8, as a careless client sends them
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def survives(fmt: Format, body: bytes) -> None:
    """A body is served or refused with a 4xx; a job that is built can be sent over the bus."""
    try:
        job = fmt.build(body)
    except TokenbusError as exc:
        assert 400 <= exc.status < 500, f"{type(exc).__name__} ({exc.status}): {exc.message}"
        return
    assert bus.decode_job(bus.encode_job(job)).id == job.id


@pytest.mark.parametrize("name", FORMATS)
def test_arbitrary_bytes_are_refused_with_a_4xx(name: str) -> None:
    @FUZZ
    @given(body=st.binary(max_size=64) | st.binary(max_size=8).map(lambda b: b'{"model": "' + b + b'"}'))
    def check(body: bytes) -> None:
        survives(FORMATS[name], body)

    check()


@pytest.mark.parametrize("name", FORMATS)
def test_arbitrary_json_is_refused_with_a_4xx(name: str) -> None:
    @FUZZ
    @given(value=JSON, ascii_only=st.booleans())
    def check(value: Any, ascii_only: bool) -> None:
        survives(FORMATS[name], _encoded(value, ascii_only))

    check()


@pytest.mark.parametrize("name", FORMATS)
def test_valid_bodies_with_hostile_fields_are_served_or_refused_with_a_4xx(name: str) -> None:
    fmt = FORMATS[name]

    @FUZZ
    @given(value=_struct_bodies(fmt.kind, fmt.example), ascii_only=st.booleans())
    def check(value: Any, ascii_only: bool) -> None:
        survives(fmt, _encoded(value, ascii_only))

    check()


FIELDS = [(name, field) for name, fmt in FORMATS.items() for field in fmt.kind.__struct_fields__]


@pytest.mark.parametrize(("name", "field"), FIELDS)
def test_each_field_at_its_edges_is_served_or_refused_with_a_4xx(name: str, field: str) -> None:
    fmt = FORMATS[name]
    values = _values(typing.get_type_hints(fmt.kind, include_extras=True)[field], 0)

    @settings(FUZZ, max_examples=40)
    @given(value=values, ascii_only=st.booleans())
    def check(value: Any, ascii_only: bool) -> None:
        survives(fmt, _encoded({**fmt.example, field: value}, ascii_only))

    check()


@pytest.mark.parametrize(
    ("name", "body"),
    [("chat", b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "seed": ' + b"9" * 5000 + b"}"),
     ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tool_choice": '
      + b"[" * 100_000 + b"]" * 100_000 + b"}"),
     ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
     ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"\xc2\xb2": 1}}'),
     ("completions", b'{"model": "m", "prompt": "Hi", "logit_bias": {"' + b"1" * 5000 + b'": 1}}'),
     ("completions", b'{"model": "m", "prompt": "Hi", "min_tokens": ' + str(2**80).encode() + b"}"),
     ("responses", b'{"model": "m", "input": "Hi", "temperature": 1e400}'),
     ("embeddings", b'{"model": "m", "input": "Hi", "dimensions": ' + str(2**64).encode() + b"}"),
     ("tgi", b'{"inputs": "Hi", "parameters": {"seed": ' + str(2**80).encode() + b"}}"),
     ("tgi", b'{"inputs": "Hi", "parameters": {"max_new_tokens": 2048}}'),
     ("tgi", b'{"inputs": "Hi", "grammar": ' + b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000 + b"}")],
)
def test_known_hostile_bodies_are_refused_with_a_4xx(name: str, body: bytes) -> None:
    with pytest.raises(TokenbusError) as caught:
        FORMATS[name].build(body)
    assert 400 <= caught.value.status < 500
