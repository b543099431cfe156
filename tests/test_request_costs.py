"""What one request may cost the edge and the engine, checked on the request alone (no Redis, no worker): the
token estimate admission charges, the bounds on what a request multiplies, and the schema checks."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from services.edge.estimate import estimate, text_tokens
from services.edge.formats import calling, chat, completions, embeddings, structured, tgi
from services.edge.formats.base import decode
from services.edge.handlers import parse_event_id
from services.worker.models import default_chat_model_dir
from services.worker.template_kwargs import allowed, template_variables
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

IDS = {"job_id": "job-1", "reply_to": "r", "deadline_ms": 1}


def _job(kind: type[Any], module: Any, **fields: Any) -> bus.Job:
    req = decode(json.dumps({"model": "m", **fields}).encode(), kind)
    job: bus.Job = module.to_job(req, **IDS)
    return job


def chat_job(**fields: Any) -> bus.Job:
    return _job(chat.ChatCompletionRequest, chat, **fields)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(default_chat_model_dir() / "tokenizer.json"))


TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. " * 40,
    "chinese": "我们今天在北京讨论了人工智能的未来发展方向和挑战。" * 40,
    "emoji": "🚀🔥🎉😀🧠🦀" * 80,
    "mixed": "Prix: 12€ — naïve café, Ünïcödé façade. " * 40,
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_estimate_reserves_at_least_what_the_default_models_tokenizer_counts(tokenizer: Tokenizer,
                                                                                  name: str) -> None:
    text = TEXTS[name]
    real = len(tokenizer.encode(text, add_special_tokens=False).ids)
    assert text_tokens(text) >= real, f"{name}: reserved {text_tokens(text)} for {real} tokens"
    if name == "english":  # and does not refuse plain English for four times what it costs
        assert text_tokens(text) <= 2 * real


def test_a_budget_beyond_any_context_still_fits_the_bus() -> None:
    job = _job(completions.CompletionRequest, completions, prompt=["x"] * 256, n=16, max_tokens=2**63 - 1,
               error_behavior="truncate")
    prompt, output = estimate(job, 2048)
    assert output == 2048 * 16 * 256
    job.prompt_estimate, job.output_budget = prompt, output
    assert bus.encode_job(job)  # no OverflowError (the edge answered 500 for it)
    _prompt, unknown_context = estimate(job, 0)
    assert unknown_context < 2**63


def test_every_text_a_chat_template_may_render_is_charged() -> None:
    """Reasoning sent back in an assistant message is rendered by the worker like its content: admission
    reserves it too (it was free: 400 kB of it charged 14 tokens)."""
    text = "x" * 400_000
    answered = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}

    def charged(message: dict[str, Any]) -> int:
        result = {"role": "tool", "content": "", "tool_call_id": "call-1"}
        return estimate(chat_job(messages=[{"role": "user", "content": "hi"}, message, result]), 2048)[0]

    for name in ("reasoning", "reasoning_content"):
        assert charged({**answered, name: text}) - charged(answered) >= text_tokens(text), name


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_a_tgi_sampling_factor_beyond_float32_never_reaches_the_engine(name: str) -> None:
    """TGI bounds neither; vLLM refuses a temperature over 2 only once the job reached a worker, and computes in
    float32, where a penalty of 1e300 is infinite (and 0 x inf is NaN)."""
    with pytest.raises(InvalidRequest) as caught:
        decode(json.dumps({"inputs": "x", "parameters": {name: 1e300}}).encode(), tgi.GenerateRequest)
    assert caught.value.param == f"parameters.{name}"
    assert decode(json.dumps({"inputs": "x", "parameters": {name: 1.5}}).encode(), tgi.GenerateRequest)


def test_what_the_engine_would_refuse_after_the_queue_is_refused_at_once() -> None:
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest) as caught:
        chat_job(messages=user, min_tokens=10, max_tokens=5)
    assert caught.value.param == "min_tokens"
    assert chat_job(messages=user, n=2, temperature=0).params.n == 2  # served: one greedy answer, n choices
    assert chat_job(messages=user, min_tokens=5, max_tokens=5).params.min_tokens == 5


def test_an_embedding_instruction_is_sent_once_and_charged_per_input() -> None:
    instruction = "Represent this sentence for searching relevant passages: "
    job = _job(embeddings.EmbeddingRequest, embeddings, input=["a", "b", "c"], instruction=instruction)
    assert job.prompts == ["a", "b", "c"] and job.instruction == instruction
    plain = _job(embeddings.EmbeddingRequest, embeddings, input=["a", "b", "c"])
    assert estimate(job, 512)[0] - estimate(plain, 512)[0] == 3 * text_tokens(instruction)
    with pytest.raises(InvalidRequest) as caught:
        decode(json.dumps({"model": "m", "input": "a", "instruction": "x" * 100_000}).encode(),
               embeddings.EmbeddingRequest)
    assert caught.value.param == "instruction"


def test_a_prompt_of_token_ids_is_charged_its_ids_and_bounded_as_text_prompts_are() -> None:
    job = _job(completions.CompletionRequest, completions, prompt=[[5] * 300, [7] * 20], max_tokens=4, n=2)
    assert job.prompt_ids == [[5] * 300, [7] * 20] and job.prompts == ["", ""]
    assert estimate(job, 2048) == (320, 4 * 2 * 2)
    for prompt in ([[1]] * 257, [[1], "a"]):
        with pytest.raises(InvalidRequest) as caught:
            _job(completions.CompletionRequest, completions, prompt=prompt)
        assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequest) as too_long:
        completions.check_context(decode(json.dumps({"model": "m", "prompt": [1] * 2045, "max_tokens": 4}).encode(),
                                         completions.CompletionRequest), 2048)
    assert "2049 tokens (2045 in the prompt, 4 in the completion)" in too_long.value.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": ["p"] * 256, "n": 16, "suffix": "s" * 1000}, "suffix"),
    ({"prompt": ["p" * 100_000] * 2, "n": 16, "echo": True}, "echo"),
])
def test_what_an_answer_repeats_is_bounded(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _job(completions.CompletionRequest, completions, **fields)
    assert caught.value.param == param
    _job(completions.CompletionRequest, completions, prompt=["p"] * 4, n=2, suffix="s" * 1000, echo=True)


def test_logit_bias_and_messages_have_caps() -> None:
    user = {"role": "user", "content": "hi"}
    with pytest.raises(InvalidRequest, match="300"):
        chat_job(messages=[user], logit_bias={str(i): 1 for i in range(301)})
    assert len(chat_job(messages=[user], logit_bias={str(i): 1 for i in range(300)}).params.logit_bias) == 300
    with pytest.raises(InvalidRequest) as caught:
        chat_job(messages=[user] * 10_000)
    assert caught.value.param == "messages"


def _wide(properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 10}
                                             for i in range(properties)}}


@pytest.mark.parametrize(("schema", "message"), [
    (_wide(20_000), "larger than"),
    (json.dumps(_wide(20_000)), "larger than"),
    ({"anyOf": [{"type": "integer", "minimum": i} for i in range(600)]}, "alternatives"),
    ({"type": "object", "properties": {"a": {"type": 5}}}, "not a valid JSON schema"),
])
def test_a_schema_is_refused_on_its_size_and_shape_before_it_is_checked(schema: Any, message: str) -> None:
    started = time.process_time()
    with pytest.raises(InvalidRequest, match=message) as caught:
        structured.checked_schema(schema, "response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"
    assert time.process_time() - started < 0.5  # was 1.4 s of CPU on the event loop for a 64 kB anyOf


def test_a_deeply_nested_schema_is_refused() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequest, match="nested deeper"):
        structured.checked_schema(deep, "tools")


@pytest.mark.parametrize("pattern", ["(" * 1000 + "a" + ")" * 1000, "a{99999999999}", "(unclosed"])
def test_a_pattern_re_cannot_compile_is_a_400_naming_it(pattern: str) -> None:
    """A recursion or an overflow while compiling was a 500."""
    with pytest.raises(InvalidRequest) as caught:
        structured.regex(pattern, "structured_outputs.regex")
    assert caught.value.param == "structured_outputs.regex"


def _items_tool(name: str, max_items: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "maxItems": max_items}}}}}


HI = [{"role": "user", "content": "hi"}]
NO_ITEMS = {"type": "array", "minItems": 1}
"""An array without `items`: XGrammar refuses it, so vLLM's llguidance fallback counts out its items."""


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "minItems": 100_000_000}}}}, "response_format.json_schema.schema"),  # held a worker 18 s
    ({"structured_outputs": {"json": {"anyOf": [{**NO_ITEMS, "maxItems": 5000.0}] * 2}}}, "structured_outputs.json"),
    ({"tool_choice": "required", "tools": [_items_tool(f"f{i}", 4000) for i in range(3)]}, "tools"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": f"<f{i}>", "end": "</f>", "schema": {**NO_ITEMS, "maxItems": 6000}} for i in range(2)]}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        **NO_ITEMS, "maxItems": 10**7}}}}, "response_format"),
])
def test_a_constraint_counting_out_too_many_array_items_is_refused(fields: dict[str, Any], param: str) -> None:
    """However its items are spread: one count, alternatives, the functions a forced call may take, the
    structures of a structural tag, a tag's `format` (which no schema check reads)."""
    with pytest.raises(InvalidRequest, match="array items") as caught:
        chat_job(messages=HI, **fields)
    assert caught.value.param == param


def test_a_constraint_within_the_items_bound_is_taken() -> None:
    job = chat_job(messages=HI, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"maxItems": {**NO_ITEMS, "maxItems": 9_998}},
        "const": {"note": "minItems"}}}})
    assert job.params.constraint is not None and job.params.constraint.kind == "json"
    chat_job(messages=HI, tool_choice="required", tools=[_items_tool(f"f{i}", 3000) for i in range(3)])


def test_a_forced_choice_of_a_function_whose_defs_are_no_object_is_a_400() -> None:
    """`$defs` is no keyword of draft 4, so `5` is valid there; lifting it to the combined schema was a 500."""
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "$defs": 5}
    assert calling._lift_defs([bus.Tool(name="f", parameters=draft4)])[0] == [draft4]
    with pytest.raises(InvalidRequest) as caught:  # the combined schema is of draft 2020-12
        chat_job(messages=[{"role": "user", "content": "hi"}], tool_choice="required",
                 tools=[{"type": "function", "function": {"name": "f", "parameters": draft4}}])
    assert caught.value.param == "tools"


def test_the_functions_parameters_are_bounded_all_together() -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "description": "d" * 8000}}}}} for i in range(32)]
    with pytest.raises(InvalidRequest, match="bytes of JSON") as caught:
        chat_job(messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert caught.value.param == "tools"


@pytest.mark.parametrize("value", ["x:²", "x:" + "9" * 5000, "x:-1", "nocolon"])
def test_a_last_event_id_that_is_not_ours_is_a_400(value: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_event_id(value)
    assert caught.value.param == "Last-Event-ID"


def test_only_the_variables_a_chat_template_reads_reach_it() -> None:
    template = ("{% if enable_thinking %}<think>{% endif %}{{ bos_token }}{% for m in messages %}{{ m.content }}"
                "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    variables = template_variables(template)
    given = {"enable_thinking": True, "bos_token": "<evil>", "add_generation_prompt": False, "other": 1}
    assert allowed(variables, given) == {"enable_thinking": True}
    assert template_variables("{% generation %}x{% endgeneration %}") == frozenset()


def test_struct_limits_are_declared_not_hand_checked() -> None:
    """The caps above live in the request structs, so /openapi.json shows them to clients."""
    schema = msgspec.json.schema(chat.ChatCompletionRequest)
    defs = schema["$defs"]["ChatCompletionRequest"]["properties"]
    assert defs["messages"]["maxItems"] == 2048
    assert defs["logit_bias"]["anyOf"][0]["maxProperties"] == 300


def test_a_continued_conversation_is_bounded_with_its_history() -> None:
    from services.edge.formats import responses
    from services.edge.store import Conversation

    req = decode(json.dumps({"model": "m", "input": "next", "previous_response_id": "resp_1"}).encode(),
                 responses.ResponsesRequest)
    added = responses.input_messages(req)
    history = [bus.Message(role="user", content="x")] * 2047
    responses.check_length(req, Conversation(history=history), added)
    with pytest.raises(InvalidRequest) as caught:
        responses.check_length(req, Conversation(history=[*history, history[0]]), added)
    assert caught.value.param == "previous_response_id"


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    for _ in range(levels):
        value = {"a": value}
    return value


def test_an_object_json_cannot_carry_on_is_a_400_naming_it_wherever_it_is_sent() -> None:
    """Beyond 254 levels (orjson's limit) a call's arguments, a call's result given as an object, or a structural
    tag's `format` could not be written out again: the edge answered 500."""
    from services.edge.formats import responses

    deep = _nested(300)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]}
    with pytest.raises(InvalidRequest) as caught:
        chat_job(messages=[*HI, call, {"role": "tool", "tool_call_id": "c1", "content": "x"}])
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(InvalidRequest) as caught:
        chat_job(messages=HI, response_format={"type": "structural_tag", "format": deep})
    assert caught.value.param == "response_format"
    for items, param in (
            ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
              {"type": "function_call_output", "call_id": "c1", "output": "x"}], "input[0].arguments"),
            ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"a": 2**70}},
              {"type": "function_call_output", "call_id": "c1", "output": "x"}], "input[0].arguments"),
            ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
              {"type": "function_call_output", "call_id": "c1", "output": deep}], "input[1].output")):
        req = decode(json.dumps({"model": "m", "input": items}).encode(), responses.ResponsesRequest)
        with pytest.raises(InvalidRequest) as caught:
            responses.input_messages(req)
        assert caught.value.param == param
    within = {**call, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f",
                                                                               "arguments": _nested(200)}}]}
    assert chat_job(messages=[*HI, within, {"role": "tool", "tool_call_id": "c1", "content": "x"}]).messages
