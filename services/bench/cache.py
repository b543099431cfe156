"""Dispatch and the prefix cache, on the simulated engine with a prefix cache of fixed size per worker (prefills
cost only the prompt words past the leading blocks a worker holds): time to first token, throughput and the
workers' hit rate at 2, 4 and 8 workers, on three workloads:

- shared prefixes: many tenants' long system prompts, each request one of them and a short question;
- multi-turn: conversations whose every turn sends the whole history again, plus the new turn;
- no shared prefix: long prompts that share nothing (where placement cannot help, and must not hurt).

Each worker's cache holds a fraction of the workload's prefixes: a dispatch that sends every job to any free
worker (today's) finds a prefix where it was prefilled only by chance; issue 38's cache-aware dispatch is measured
against these figures."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.bench import load, systems
from services.bench.stats import Summary
from services.bench.workload import Request, prompt_of

SHARED, MULTI_TURN, UNSHARED = "shared prefixes", "multi-turn", "no shared prefix"
WORKLOADS = (SHARED, MULTI_TURN, UNSHARED)


@dataclass(frozen=True)
class Plan:
    workers: tuple[int, ...] = (2, 4, 8)
    tenants: int = 32
    """System prompts of the shared-prefix workload."""
    prefix_words: int = 1024
    question_words: int = 16
    conversations: int = 32
    turns: int = 6
    turn_words: int = 160
    requests: int = 384
    concurrency: int = 32
    max_tokens: int = 8
    slots: int = 16
    cache_blocks: int = 512
    """Per worker: 8 of the 32 system prompts (64 blocks of 16 words each)."""
    sim_ttft_ms: float = 10.0
    sim_itl_ms: float = 10.0
    prefill_us_per_word: float = 200.0
    """A 1,024-word prompt prefills in about 0.2 s, in one lane per worker."""

    @classmethod
    def quick(cls) -> Plan:
        return cls(workers=(2,), tenants=8, requests=64, conversations=8, turns=3, concurrency=8, cache_blocks=128)


@dataclass(frozen=True)
class Cell:
    workload: str
    workers: int
    ttft_ms: Summary
    output_throughput: float
    hit_rate: float
    """Prompt words the workers' caches held, of those looked up."""
    requests: int
    failed: int


@dataclass(frozen=True)
class Result:
    plan: Plan
    dispatch: str
    cells: list[Cell]


def workload(name: str, plan: Plan, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded workload
    if name == SHARED:
        prefixes = [prompt_of(plan.prefix_words, rng) for _ in range(plan.tenants)]
        return [Request(f"{rng.choice(prefixes)} {prompt_of(plan.question_words, rng)}",
                        plan.prefix_words + plan.question_words, plan.max_tokens) for _ in range(plan.requests)]
    if name == MULTI_TURN:
        histories = [prompt_of(plan.prefix_words // 2, rng) for _ in range(plan.conversations)]
        out = []
        for _turn in range(plan.turns):  # every conversation's next turn, one after the other
            for c in range(plan.conversations):
                histories[c] += " " + prompt_of(plan.turn_words, rng)
                out.append(Request(histories[c], len(histories[c].split()), plan.max_tokens))
        return out
    return [Request(prompt_of(plan.prefix_words + plan.question_words, rng), plan.prefix_words + plan.question_words,
                    plan.max_tokens) for _ in range(plan.requests)]


def measure(log: Path, plan: Plan, dispatch: str = "cache-blind") -> Result:
    engine = systems.Engine(model="sim-model", model_dir=Path("."))
    cells = []
    for name in WORKLOADS:
        for workers in plan.workers:
            with systems.tokenbus(engine, log, sim=(plan.sim_ttft_ms, plan.sim_itl_ms), workers=workers,
                                  worker_settings={"max_num_seqs": plan.slots,
                                                   "sim_prefill_us_per_token": plan.prefill_us_per_word,
                                                   "sim_prefix_cache_blocks": plan.cache_blocks}) as running:
                cells.append(asyncio.run(_cell(running, engine.model, name, workers, plan)))
    return Result(plan, dispatch, cells)


async def _cell(running: systems.Running, model: str, name: str, workers: int, plan: Plan) -> Cell:
    shape = load.Load(running.base_url, model, concurrency=plan.concurrency)
    result = await load.run(shape, workload(name, plan), system=f"{workers} workers", quiet=True)
    queried = hit = 0.0
    async with httpx.AsyncClient(timeout=10) as http:
        for url in running.worker_metrics_urls:
            text = (await http.get(url)).text
            queried += _sample(text, "tokenbus_worker_prefix_cache_queries_total")
            hit += _sample(text, "tokenbus_worker_prefix_cache_hits_total")
    return Cell(name, workers, result.ttft_ms, result.output_throughput, hit / queried if queried else 0.0,
                result.requests, result.failed)


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
