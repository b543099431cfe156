"""A constraint slow to compile, and what other requests see beside it, with the worker's grammar gate off
(--grammar-compile-s 0: vLLM's engine compiles it, with no deadline) and on (5 s), on the real engine
(systems.tokenbus: Redis, a vLLM worker, an edge with keys). Each round, a tenant sends a schema of 40 distinct
bounded string lengths (new each round), then 0.5 s later, together: another tenant's small schema (new each round)
and its plain stream of 64 tokens. Prints per round: the slow request's status and seconds, the small schema's seconds, the plain stream's
median and longest gap between tokens. Not a test: read what it prints (docs/benchmarks.md has a run).

    .venv/bin/python docs/sweeps/slow_grammar.py [ROUNDS [GRAMMAR_COMPILE_S ...]]
"""
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from services.bench import systems
from services.bench.cli import _engine
from shared.redisio import clients as redis_clients
from shared.tenancy import apikeys

M = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def schema_request(schema: dict, max_tokens: int) -> dict:
    return {"model": M, "messages": ASK, "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


async def timed(http: httpx.AsyncClient, body: dict) -> tuple[int, float]:
    started = time.monotonic()
    answer = await http.post("/v1/chat/completions", json=body)
    return answer.status_code, time.monotonic() - started


async def gaps(http: httpx.AsyncClient) -> list[float]:
    stamps = []
    body = {"model": M, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 64,
            "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def keys(redis_url: str) -> list[str]:
    redis = redis_clients.pooled(redis_url, "sweep", 1)
    try:
        return [(await apikeys.create(redis, apikeys.KeyChanges(tenant=tenant)))[0] for tenant in ("slow", "other")]
    finally:
        await redis.aclose()


async def rounds(run: systems.Running, label: str) -> None:
    slow_key, other_key = await keys(run.redis_url)
    async with httpx.AsyncClient(base_url=run.base_url, timeout=300, headers={"Authorization": f"Bearer {other_key}"}
                                 ) as http, \
            httpx.AsyncClient(base_url=run.base_url, timeout=300, headers={"Authorization": f"Bearer {slow_key}"}
                              ) as slow_http:
        await timed(http, schema_request({"type": "object"}, 4))  # the engine's first request
        for n in range(ROUNDS):
            slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 3000 + 50 * n + i}
                                                     for i in range(40)}}
            small = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20 + n}}}
            slow_task = asyncio.create_task(timed(slow_http, schema_request(slow, 8)))
            await asyncio.sleep(0.5)
            (_, small_s), plain = await asyncio.gather(timed(http, schema_request(small, 16)), gaps(http))
            status, slow_s = await slow_task
            print(f"{label} round {n}: slow {status} in {slow_s:5.1f} s | small schema beside {small_s:5.2f} s | "
                  f"plain stream gap median {1000 * statistics.median(plain):5.1f} ms, "
                  f"longest {1000 * max(plain):6.1f} ms", flush=True)


for deadline in [float(d) for d in sys.argv[2:]] or (0.0, 5.0):
    log = Path(tempfile.mkdtemp(prefix="slow-grammar-")) / "sys.log"
    with systems.tokenbus(_engine(None), log, edge_settings={"auth": "keys"},
                          worker_settings={"grammar_compile_s": deadline}) as run:
        asyncio.run(rounds(run, f"grammar_compile_s={deadline:g}"))
