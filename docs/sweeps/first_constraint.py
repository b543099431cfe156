"""Does a worker's first constraint decide how it serves every later one? Two fresh workers (systems.tokenbus, the
real engine): one whose first constraint is a schema vLLM's check gives llguidance (`multipleOf`), one whose first
is an ordinary schema; each then gets the same constrained requests. Prints status and the start of each answer:
the two workers should agree. Before the worker chose XGrammar at start (vllm_terms.choose_xgrammar), the first
compiled everything with llguidance: its structural tag was a 400, its plain schema's object grew properties. Not a
test (tests/test_structured.py has one): read what it prints.

    .venv/bin/python docs/sweeps/first_constraint.py
"""
import asyncio, tempfile, json, re
from pathlib import Path
import httpx
from services.bench import systems
from services.bench.cli import _engine
M = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
def rf(schema): return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
CASES = [
  ("multipleOf (llguidance-routed)", {"response_format": rf({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}, "required": ["n"]})}),
  ("plain schema", {"response_format": rf(PERSON)}),
  ("structural tag", {"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<person>", "end": "</person>", "content": {"type": "json_schema", "json_schema": PERSON}}}}),
  ("choice", {"structured_outputs": {"choice": ["yes", "no"]}}),
  ("regex", {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}),
  ("array minItems no items", {"response_format": rf({"type": "array", "minItems": 2})}),
  ("multipleOf again", {"response_format": rf({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}, "required": ["n"]})}),
]
async def main(url, order):
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for name, extra in order:
            r = await http.post("/v1/chat/completions", json={"model": M, "messages": ASK, "max_tokens": 40, "temperature": 0, **extra})
            body = r.json()
            text = body["choices"][0]["message"]["content"] if r.status_code == 200 else body["error"]["message"][:120]
            print(f"  {r.status_code} {name}: {text!r}"[:200], flush=True)
for label, order in (("fresh worker, llguidance-routed first", CASES), ("fresh worker, plain first", [CASES[1], CASES[0], CASES[5], CASES[2]])):
    print(label)
    log = Path(tempfile.mkdtemp()) / "s.log"
    with systems.tokenbus(_engine(None), log) as run:
        asyncio.run(main(run.base_url, order))
