"""Unusual but valid requests against tokenbus on the real engine (systems.tokenbus: Redis, a vLLM worker, an edge),
one line each: status, seconds, the start of the body; `!!!` marks a 5xx. Found, on 2026-11-28, the array schema
that froze a worker (structured.MAX_SCHEMA_ITEMS). Not a test: read what it prints.

    .venv/bin/python docs/sweeps/unusual_requests.py [SUBSTRING ...]   (only the cases whose name has one)
"""
import sys, tempfile, time, json
from pathlib import Path
import httpx
from services.bench import systems
from services.bench.cli import _engine
M = "SmolLM2-135M-Instruct"
U = [{"role": "user", "content": "Say hi."}]
CASES = [
 ("chat n3 logprobs stream", "/v1/chat/completions", dict(messages=U, n=3, temperature=1, logprobs=True, top_logprobs=5, max_tokens=5, stream=True)),
 ("chat max_tokens 0", "/v1/chat/completions", dict(messages=U, max_tokens=0)),
 ("chat max_completion_tokens 0", "/v1/chat/completions", dict(messages=U, max_completion_tokens=0)),
 ("chat stop 5", "/v1/chat/completions", dict(messages=U, stop=["a","b","c","d","e"], max_tokens=5)),
 ("chat stop empty string", "/v1/chat/completions", dict(messages=U, stop=[""], max_tokens=5)),
 ("chat logit_bias oov", "/v1/chat/completions", dict(messages=U, logit_bias={"1000000000": 5}, max_tokens=5)),
 ("chat logit_bias negative id", "/v1/chat/completions", dict(messages=U, logit_bias={"-1": 5}, max_tokens=5)),
 ("chat logit_bias 1000", "/v1/chat/completions", dict(messages=U, logit_bias={"42": 1000}, max_tokens=5)),
 ("chat logit_bias non-int key", "/v1/chat/completions", dict(messages=U, logit_bias={"abc": 5}, max_tokens=5)),
 ("chat json_object", "/v1/chat/completions", dict(messages=U, response_format={"type": "json_object"}, max_tokens=10)),
 ("chat schema pattern", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}, "required": ["a"]}}})),
 ("chat schema format date-time", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "date-time"}}}}})),
 ("chat schema recursive ref", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}}})),
 ("chat schema bad ref", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}})),
 ("chat schema minItems huge", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "minItems": 100000000}}})),
 ("chat schema enum empty", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}})),
 ("chat schema type unknown", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})),
 ("chat schema bool false", "/v1/chat/completions", dict(messages=U, max_tokens=10, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": False}})),
 ("chat tools required stream", "/v1/chat/completions", dict(messages=U, max_tokens=30, stream=True, tool_choice="required", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}])),
 ("chat tools no params", "/v1/chat/completions", dict(messages=U, max_tokens=30, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "f"}})),
 ("chat image part", "/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], max_tokens=5)),
 ("chat text parts", "/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}], max_tokens=5)),
 ("chat empty messages", "/v1/chat/completions", dict(messages=[], max_tokens=5)),
 ("chat developer role", "/v1/chat/completions", dict(messages=[{"role": "developer", "content": "Be brief."}] + U, max_tokens=5)),
 ("chat continue_final_message", "/v1/chat/completions", dict(messages=U + [{"role": "assistant", "content": "Hello"}], add_generation_prompt=False, continue_final_message=True, max_tokens=5)),
 ("chat top_logprobs 21", "/v1/chat/completions", dict(messages=U, logprobs=True, top_logprobs=21, max_tokens=5)),
 ("chat top_logprobs without logprobs", "/v1/chat/completions", dict(messages=U, top_logprobs=3, max_tokens=5)),
 ("chat presence 2.5", "/v1/chat/completions", dict(messages=U, presence_penalty=2.5, max_tokens=5)),
 ("chat n 0", "/v1/chat/completions", dict(messages=U, n=0, max_tokens=5)),
 ("chat n 128", "/v1/chat/completions", dict(messages=U, n=128, max_tokens=2)),
 ("chat min_tokens > max", "/v1/chat/completions", dict(messages=U, min_tokens=10, max_tokens=5)),
 ("chat stop_token_ids oov", "/v1/chat/completions", dict(messages=U, stop_token_ids=[10**9], max_tokens=5)),
 ("chat bad_words", "/v1/chat/completions", dict(messages=U, bad_words=["hi"], max_tokens=5)),
 ("chat allowed_token_ids oov", "/v1/chat/completions", dict(messages=U, allowed_token_ids=[10**9], max_tokens=5)),
 ("chat allowed_token_ids empty", "/v1/chat/completions", dict(messages=U, allowed_token_ids=[], max_tokens=5)),
 ("chat structured grammar bad", "/v1/chat/completions", dict(messages=U, structured_outputs={"grammar": "root ::= ("}, max_tokens=5)),
 ("chat structured choice empty", "/v1/chat/completions", dict(messages=U, structured_outputs={"choice": []}, max_tokens=5)),
 ("chat structured regex empty", "/v1/chat/completions", dict(messages=U, structured_outputs={"regex": ""}, max_tokens=5)),
 ("chat guided_json", "/v1/chat/completions", dict(messages=U, guided_json={"type": "object"}, max_tokens=5)),
 ("chat repetition_penalty 0", "/v1/chat/completions", dict(messages=U, repetition_penalty=0, max_tokens=5)),
 ("chat top_k -5", "/v1/chat/completions", dict(messages=U, top_k=-5, max_tokens=5)),
 ("chat top_p 0", "/v1/chat/completions", dict(messages=U, top_p=0, max_tokens=5)),
 ("chat temperature 1e9", "/v1/chat/completions", dict(messages=U, temperature=1e9, max_tokens=5)),
 ("chat seed huge", "/v1/chat/completions", dict(messages=U, seed=2**70, max_tokens=5)),
 ("chat seed negative", "/v1/chat/completions", dict(messages=U, seed=-1, max_tokens=5)),
 ("chat prompt_logprobs", "/v1/chat/completions", dict(messages=U, prompt_logprobs=3, max_tokens=2)),
 ("chat echo", "/v1/chat/completions", dict(messages=U, echo=True, max_tokens=2)),
 ("chat truncate_prompt_tokens", "/v1/chat/completions", dict(messages=U, truncate_prompt_tokens=3, max_tokens=2)),
 ("chat chat_template override", "/v1/chat/completions", dict(messages=U, chat_template="{{ 1/0 }}", max_tokens=2)),
 ("chat template kwargs weird", "/v1/chat/completions", dict(messages=U, chat_template_kwargs={"__class__": 1}, max_tokens=2)),
 ("cmpl token ids oov", "/v1/completions", dict(prompt=[1, 2, 10**9], max_tokens=2)),
 ("cmpl token ids negative", "/v1/completions", dict(prompt=[1, -5], max_tokens=2)),
 ("cmpl empty prompt", "/v1/completions", dict(prompt="", max_tokens=2)),
 ("cmpl empty token list", "/v1/completions", dict(prompt=[], max_tokens=2)),
 ("cmpl list of lists", "/v1/completions", dict(prompt=[[1, 2], [3]], max_tokens=2)),
 ("cmpl suffix", "/v1/completions", dict(prompt="a", suffix="b", max_tokens=2)),
 ("cmpl best_of 3 n1", "/v1/completions", dict(prompt="a", best_of=3, max_tokens=2)),
 ("cmpl echo logprobs stream", "/v1/completions", dict(prompt="Hello there", echo=True, logprobs=3, max_tokens=2, stream=True)),
 ("cmpl logprobs 6", "/v1/completions", dict(prompt="a", logprobs=6, max_tokens=2)),
 ("cmpl echo max_tokens 0", "/v1/completions", dict(prompt="Hello", echo=True, max_tokens=0)),
 ("resp basic", "/v1/responses", dict(input="Say hi", max_output_tokens=5)),
 ("resp items", "/v1/responses", dict(input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], instructions="Be brief", max_output_tokens=5)),
 ("resp json_schema", "/v1/responses", dict(input="hi", max_output_tokens=10, text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})),
 ("resp unknown previous", "/v1/responses", dict(input="hi", previous_response_id="resp_nope", max_output_tokens=5)),
 ("resp max_output 0", "/v1/responses", dict(input="hi", max_output_tokens=0)),
 ("resp image input", "/v1/responses", dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], max_output_tokens=5)),
 ("resp function_call_output orphan", "/v1/responses", dict(input=[{"type": "function_call_output", "call_id": "c1", "output": "x"}], max_output_tokens=5)),
 ("resp tools", "/v1/responses", dict(input="hi", tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}], tool_choice="required", max_output_tokens=20)),
 ("resp builtin tool", "/v1/responses", dict(input="hi", tools=[{"type": "web_search"}], max_output_tokens=5)),
 ("resp stream", "/v1/responses", dict(input="hi", stream=True, max_output_tokens=3)),
 ("tgi details", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 3, "details": True, "decoder_input_details": True, "top_n_tokens": 3})),
 ("tgi best_of", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 3, "best_of": 2, "do_sample": True})),
 ("tgi truncate 1", "/generate", dict(inputs="Hi there friend", parameters={"max_new_tokens": 3, "truncate": 1})),
 ("tgi grammar json", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 5, "grammar": {"type": "json", "value": {"type": "object"}}})),
 ("tgi grammar regex bad", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 5, "grammar": {"type": "regex", "value": "("}})),
 ("tgi empty inputs", "/generate", dict(inputs="", parameters={"max_new_tokens": 3})),
 ("tgi stream", "/generate_stream", dict(inputs="Hi", parameters={"max_new_tokens": 3})),
 ("tgi stop many", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 3, "stop": ["x"] * 10})),
 ("tgi typical_p 1", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 3, "typical_p": 1.0})),
 ("tgi watermark", "/generate", dict(inputs="Hi", parameters={"max_new_tokens": 3, "watermark": True})),
 ("tgi tokenize", "/tokenize", dict(inputs="Hi there")),
 ("chat tokenize", "/tokenize", dict(model=M, messages=U)),
 ("detokenize oov", "/detokenize", dict(model=M, tokens=[10**9])),
 ("messages api", "/v1/messages", dict(model=M, max_tokens=5, messages=U)),
 ("messages api thinking", "/v1/messages", dict(model=M, max_tokens=5, messages=U, thinking={"type": "enabled", "budget_tokens": 1024})),
]
eng = _engine(None)
only = sys.argv[1:] 
with systems.tokenbus(eng, Path(tempfile.mkdtemp(prefix="sweep-")) / "sys.log") as run:
    with httpx.Client(base_url=run.base_url, timeout=120) as c:
        for name, path, body in CASES:
            if only and not any(o in name for o in only):
                continue
            body = {"model": M, **body}
            t = time.time()
            try:
                r = c.post(path, json=body)
                text = r.text.replace("\n", " ")[:230]
                flag = "!!!" if r.status_code >= 500 else "   "
                print(f"{flag} {r.status_code} {time.time()-t:5.1f}s {name}: {text}", flush=True)
            except Exception as e:
                print(f"!!! EXC {time.time()-t:5.1f}s {name}: {e!r}", flush=True)
