"""Objects nested past orjson's 254 levels in every field typed Any, over the simulated engine; `!!!` marks a 5xx.
Found, on 2026-11-28, four 500s (calling.arguments_text, structured.structural_tag).

    .venv/bin/python docs/sweeps/deep_nesting.py
"""
import json
import tempfile
from pathlib import Path
import httpx
from services.bench import systems
from services.bench.cli import _engine
eng = _engine(None)
M = eng.model
def deep(n=300):
    d = {"a": 1}
    for _ in range(n):
        d = {"a": d}
    return d
D = deep()
U = {"role": "user", "content": "hi"}
CASES = [
 ("chat structural format", "/v1/chat/completions", {"messages": [U], "response_format": {"type": "structural_tag", "format": D}}),
 ("chat tool_call args dict", "/v1/chat/completions", {"messages": [U, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": D}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]}),
 ("chat template kwargs", "/v1/chat/completions", {"messages": [U], "chat_template_kwargs": {"x": D}}),
 ("chat tool params", "/v1/chat/completions", {"messages": [U], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": D}}}}]}),
 ("chat function_call any", "/v1/chat/completions", {"messages": [U], "function_call": D}),
 ("chat structural structures schema", "/v1/chat/completions", {"messages": [U], "response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [{"begin": "<f>", "end": "</f>", "schema": D}]}}),
 ("chat structured_outputs json", "/v1/chat/completions", {"messages": [U], "structured_outputs": {"json": D}}),
 ("chat structured_outputs structural", "/v1/chat/completions", {"messages": [U], "structured_outputs": {"structural_tag": D}}),
 ("resp fc args dict", "/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": D}, {"type": "function_call_output", "call_id": "c1", "output": "x"}]}),
 ("resp fc output dict", "/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": D}]}),
 ("resp metadata", "/v1/responses", {"input": "hi", "metadata": {"k": json.dumps(D)[:500]}}),
 ("resp prompt", "/v1/responses", {"input": "hi", "prompt": D}),
 ("resp conversation", "/v1/responses", {"input": "hi", "conversation": D}),
 ("resp text format schema", "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": D}}}),
 ("resp tools params", "/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": D}]}),
 ("msgs tool_use input", "/v1/messages", {"max_tokens": 3, "messages": [U, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": D}]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}),
 ("msgs metadata", "/v1/messages", {"max_tokens": 3, "messages": [U], "metadata": D}),
 ("msgs tool schema", "/v1/messages", {"max_tokens": 3, "messages": [U], "tools": [{"name": "f", "input_schema": D}]}),
 ("msgs container", "/v1/messages", {"max_tokens": 3, "messages": [U], "container": D}),
 ("tgi grammar", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3, "grammar": {"type": "json", "value": D}}}),
 ("conv create items", "/v1/conversations", {"items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x", "extra": D}]}], "metadata": {"a": "b"}}),
 ("conv create metadata", "/v1/conversations", {"metadata": D}),
 ("batch create", "/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h", "output_expires_after": D}),
 ("embeddings", "/v1/embeddings", {"input": "hi", "extra": D}),
 ("completions prompt deep list", "/v1/completions", {"prompt": json.loads("[" * 300 + "]" * 300)}),
]
with systems.tokenbus(eng, Path(tempfile.mkdtemp(prefix="sweep-")) / "deep.log", sim=(50, 20)) as run:
    with httpx.Client(base_url=run.base_url, timeout=30) as c:
        for name, path, body in CASES:
            r = c.post(path, json={"model": M, **body})
            flag = "!!!" if r.status_code >= 500 else "   "
            print(flag, r.status_code, name, r.text[:160].replace("\n", " "))
