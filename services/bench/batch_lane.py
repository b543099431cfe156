"""The batch lane on the simulated engine: an interactive tenant's time to first token alone, and while a batch
of 10,000 lines runs on the same worker; and the lines per second the batch got meanwhile.

One edge, one simulated worker with SLOTS slots. The interactive client sends one streamed chat request at a time;
the batch is uploaded and created through the Files and Batch APIs, as a client would, and cancelled once the
window is measured (its rate is what counts, not its end)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from services.bench import systems
from services.bench.client import Timing, send
from services.bench.stats import Summary
from services.bench.workload import Request, prompt_of

SLOTS = 64
TIMEOUT_S = 120.0
HEADERS = {"Authorization": "Bearer bench"}
"""An edge without keys takes an upload only with an Authorization header (any value)."""


@dataclass(frozen=True)
class Plan:
    lines: int = 10_000
    line_tokens: int = 32
    """Output tokens of each batch line."""
    tokens: int = 16
    """Output tokens of each interactive request."""
    alone_requests: int = 20
    warmup_s: float = 3.0
    """Batch running before the measured window opens."""
    window_s: float = 15.0
    sim_ttft_ms: float = 50.0
    sim_itl_ms: float = 20.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(lines=1000, alone_requests=5, warmup_s=1.0, window_s=3.0)


@dataclass(frozen=True)
class Result:
    plan: Plan
    alone_ms: Summary
    """The interactive tenant's time to first token alone."""
    during_ms: Summary
    """The same while the batch runs."""
    requests_during: int
    failed: int
    lines_per_s: float
    """Batch lines answered per second over the window."""
    lines_done: int
    """Lines answered by the end of the window."""
    batch_status: str
    """How the batch stood when the window closed (in_progress: it had lines left)."""

    @property
    def ratio(self) -> float:
        return self.during_ms.p50 / max(self.alone_ms.p50, 1e-9)


def measure(log: Path, plan: Plan) -> Result:
    engine = systems.Engine(model="sim-model", model_dir=Path("."))
    with systems.tokenbus(engine, log, sim=(plan.sim_ttft_ms, plan.sim_itl_ms),
                          worker_settings={"max_num_seqs": SLOTS}) as running:
        return asyncio.run(_measure(running.base_url, engine.model, plan))


async def _measure(base_url: str, model: str, plan: Plan) -> Result:
    request = Request(prompt_of(16, random.Random(0)), 16, plan.tokens)  # nosec B311: a benchmark's seeded workload
    url = base_url + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), headers=HEADERS) as session:
        alone = [await send(session, url, "chat", model, request) for _ in range(plan.alone_requests)]
        batch_id = await _start_batch(session, base_url, model, plan)
        await asyncio.sleep(plan.warmup_s)
        before, _status = await _progress(session, base_url, batch_id)
        opened = time.perf_counter()
        during: list[Timing] = []
        while time.perf_counter() < opened + plan.window_s:
            during.append(await send(session, url, "chat", model, request))
        window_s = time.perf_counter() - opened
        after, status = await _progress(session, base_url, batch_id)
        async with session.post(f"{base_url}/v1/batches/{batch_id}/cancel") as response:
            response.raise_for_status()
    ok = [t for t in during if t.ok]
    return Result(plan, Summary.of([t.ttft for t in alone if t.ok]).scaled(1000),
                  Summary.of([t.ttft for t in ok]).scaled(1000), len(during),
                  sum(not t.ok for t in alone + during), (after - before) / window_s, after, status)


async def _start_batch(session: aiohttp.ClientSession, base_url: str, model: str, plan: Plan) -> str:
    rng = random.Random(1)  # nosec B311: a benchmark's seeded workload
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": prompt_of(16, rng)}],
        "max_tokens": plan.line_tokens}}) + "\n" for i in range(plan.lines))
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", lines.encode(), filename="batch.jsonl", content_type="application/jsonl")
    async with session.post(base_url + "/v1/files", data=form) as response:
        response.raise_for_status()
        file_id = (await response.json())["id"]
    async with session.post(base_url + "/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}) as response:
        response.raise_for_status()
        batch_id: str = (await response.json())["id"]
    return batch_id


async def _progress(session: aiohttp.ClientSession, base_url: str, batch_id: str) -> tuple[int, str]:
    """Lines answered so far, and the batch's status."""
    async with session.get(f"{base_url}/v1/batches/{batch_id}") as response:
        response.raise_for_status()
        batch = await response.json()
    counts = batch["request_counts"]
    return int(counts["completed"]) + int(counts["failed"]), str(batch["status"])
