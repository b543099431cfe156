"""Dispatch and the prefix cache, on the simulated engine with a prefix cache of fixed size per worker (prefills
cost only the prompt words past the leading blocks a worker holds): time to first token, throughput and the
workers' hit rate at 2, 4 and 8 workers, on three workloads:

- shared prefixes: many tenants' long system prompts, each request one of them and a short question;
- multi-turn: conversations whose every turn sends the whole history again, plus the new turn, once the answer to
  the last one came (the conversations side by side);
- no shared prefix: long prompts that share nothing (where placement cannot help, and must not hurt).

Each worker's cache holds a fraction of the workload's prefixes: a cache-blind dispatch (every job to any free
worker) finds a prefix where it was prefilled only by chance; cache-aware dispatch sends a job to a worker holding
its prefix. Each cell runs both, one after the other on fresh processes, in rounds (the order alternating), and the
report gives aware over blind with a two-level bootstrap interval over the rounds and their requests.

Each cell runs both ways a load can come: closed-loop (a fixed number of requests in flight, each sent once one
ends: what each dispatch can serve, its throughput, and a time to first token set by that many requests queued at
the prefill lanes) and open-loop (requests, or conversations, arriving as a Poisson process at a fixed rate, as
users come whatever the service does: time to first token at the same offered load for both dispatches, the figure
latency comparisons quote). The open-loop rate is a fraction of what blind dispatch served in the same round's
closed-loop run of the cell, so that it is a load blind dispatch sustains."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.bench import load, systems
from services.bench.stats import Interval, Summary, bootstrap_ratio_of_medians
from services.bench.workload import Request, prompt_of

SHARED, MULTI_TURN, UNSHARED = "shared prefixes", "multi-turn", "no shared prefix"
WORKLOADS = (SHARED, MULTI_TURN, UNSHARED)
DISPATCHES = ("blind", "aware")
CLOSED, OPEN = "closed", "open"


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
    rounds: int = 3
    """Runs of each dispatch per cell, blind and aware side by side (this machine's runs differ more than their
    requests do)."""
    open_load: float = 0.75
    """The open-loop arrival rate: this fraction of the requests a second blind dispatch served in the same round's
    closed-loop run of the cell."""
    open_cap: int = 512
    """Requests in flight at most in an open-loop run (a bound on the load generator, not a limit it reaches at a
    rate blind dispatch sustains)."""

    @classmethod
    def quick(cls) -> Plan:
        return cls(workers=(2,), tenants=8, requests=64, conversations=8, turns=3, concurrency=8, cache_blocks=128,
                   rounds=1)


@dataclass(frozen=True)
class Cell:
    """One run: a workload at a worker count with one dispatch."""

    workload: str
    workers: int
    dispatch: str
    ttft_ms: Summary
    ttfts: tuple[float, ...]
    """Each request's time to first token (s)."""
    output_throughput: float
    hit_rate: float
    """Prompt words the workers' caches held, of those looked up."""
    requests: int
    failed: int
    request_rate: float = 0.0
    """Requests answered a second."""
    loop: str = CLOSED
    """How the requests came: CLOSED (a fixed number in flight) or OPEN (at a fixed rate)."""


@dataclass(frozen=True)
class Pair:
    """A workload at a worker count, one way of loading it: the runs of both dispatches, round by round."""

    workload: str
    workers: int
    loop: str
    blind: tuple[Cell, ...]
    aware: tuple[Cell, ...]

    def ttft_ratio(self) -> Interval:
        """Aware over blind: time to first token p50 over every round's requests, with its interval."""
        return bootstrap_ratio_of_medians([c.ttfts for c in self.aware], [c.ttfts for c in self.blind])

    def round_ratios(self) -> list[float]:
        """Aware over blind, time to first token p50, each round on its own."""
        return [a.ttft_ms.p50 / b.ttft_ms.p50 if b.ttft_ms.p50 else float("nan")
                for b, a in zip(self.blind, self.aware, strict=True)]


def pooled_ttft_ms(cells: tuple[Cell, ...]) -> Summary:
    """Time to first token over every run's requests (ms)."""
    return Summary.of([t * 1000 for cell in cells for t in cell.ttfts])


def median_throughput(cells: tuple[Cell, ...]) -> float:
    return statistics.median(cell.output_throughput for cell in cells)


def mean_hit_rate(cells: tuple[Cell, ...]) -> float:
    return statistics.fmean(cell.hit_rate for cell in cells)


def pair_up(cells: list[Cell]) -> list[Pair]:
    """The runs grouped by workload, worker count and loop, both dispatches present, in the order they first ran."""
    grouped: dict[tuple[str, int, str], dict[str, list[Cell]]] = {}
    for cell in cells:
        grouped.setdefault((cell.workload, cell.workers, cell.loop), {}).setdefault(cell.dispatch, []).append(cell)
    return [Pair(w, n, loop, tuple(runs["blind"]), tuple(runs["aware"])) for (w, n, loop), runs in grouped.items()
            if runs.get("blind") and len(runs["blind"]) == len(runs.get("aware", ()))]


@dataclass(frozen=True)
class Result:
    plan: Plan
    cells: list[Cell]
    """Every run, every round."""
    decisions: dict[str, dict[str, float]]
    """Per cell of aware dispatch (workload, workers), its placements by reason, summed over the rounds and loops."""

    def pairs(self, loop: str = CLOSED) -> list[Pair]:
        return [pair for pair in pair_up(self.cells) if pair.loop == loop]


def workload(name: str, plan: Plan, seed: int = 0) -> list[list[Request]]:
    """The workload's sessions: a conversation's turns one after the other, any other request a session of one."""
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded workload
    if name == SHARED:
        prefixes = [prompt_of(plan.prefix_words, rng) for _ in range(plan.tenants)]
        return [[Request(f"{rng.choice(prefixes)} {prompt_of(plan.question_words, rng)}",
                         plan.prefix_words + plan.question_words, plan.max_tokens)] for _ in range(plan.requests)]
    if name == MULTI_TURN:
        conversations = []
        for _ in range(plan.conversations):
            history, turns = prompt_of(plan.prefix_words // 2, rng), []
            for _turn in range(plan.turns):  # each turn sends the whole history, then its own words
                history += " " + prompt_of(plan.turn_words, rng)
                turns.append(Request(history, len(history.split()), plan.max_tokens))
            conversations.append(turns)
        return conversations
    return [[Request(prompt_of(plan.prefix_words + plan.question_words, rng), plan.prefix_words + plan.question_words,
                     plan.max_tokens)] for _ in range(plan.requests)]


def measure(log: Path, plan: Plan) -> Result:
    engine = systems.Engine(model="sim-model", model_dir=Path("."))
    cells: list[Cell] = []
    decisions: dict[str, dict[str, float]] = {}
    for index, name, workers, order in _schedule(plan):
        closed: dict[str, Cell] = {}
        for loop in (CLOSED, OPEN):
            rate = plan.open_load * closed["blind"].request_rate if loop == OPEN else float("inf")
            for dispatch in order:
                cell, placed = _started(engine, log, Setup(name, workers, dispatch, loop, rate), plan)
                cells.append(cell)
                closed.setdefault(dispatch, cell)
                _progress(index, plan.rounds, cell)
                if dispatch == "aware":
                    summed = decisions.setdefault(f"{name}, {workers} workers", {})
                    for reason, count in placed.items():
                        summed[reason] = summed.get(reason, 0.0) + count
    return Result(plan, cells, decisions)


@dataclass(frozen=True)
class Setup:
    """What one run is: a workload at a worker count, a dispatch, a loop and (open-loop) its arrival rate."""

    workload: str
    workers: int
    dispatch: str
    loop: str = CLOSED
    rate: float = float("inf")
    """Requests a second (open-loop)."""


def _started(engine: systems.Engine, log: Path, run: Setup, plan: Plan,
             attempts: int = 3) -> tuple[Cell, dict[str, float]]:
    """One run on fresh processes, started again (up to `attempts` times) if one exits while starting."""
    for _ in range(attempts - 1):
        try:
            return _run_once(engine, log, run, plan)
        except systems.StartFailed as exc:
            print(f"{exc}: starting the run again", file=sys.stderr)
    return _run_once(engine, log, run, plan)


def _run_once(engine: systems.Engine, log: Path, run: Setup, plan: Plan) -> tuple[Cell, dict[str, float]]:
    with systems.tokenbus(engine, log, sim=(plan.sim_ttft_ms, plan.sim_itl_ms), workers=run.workers,
                          edge_settings={"dispatch": run.dispatch},
                          worker_settings={"max_num_seqs": plan.slots, "dispatch": run.dispatch,
                                           "sim_prefill_us_per_token": plan.prefill_us_per_word,
                                           "sim_prefix_cache_blocks": plan.cache_blocks}) as running:
        return asyncio.run(_cell(running, engine.model, run, plan))


def _schedule(plan: Plan) -> list[tuple[int, str, int, tuple[str, ...]]]:
    """(round, workload, workers, dispatches) in the order to run: round by round, each cell's dispatches side by
    side, the first of them alternating from round to round so that neither always runs on a cooler machine."""
    return [(index, name, workers, DISPATCHES if index % 2 == 0 else tuple(reversed(DISPATCHES)))
            for index in range(plan.rounds) for name in WORKLOADS for workers in plan.workers]


def _progress(index: int, rounds: int, cell: Cell) -> None:
    print(f"round {index + 1}/{rounds}: {cell.workload}, {cell.workers} workers, {cell.dispatch}, {cell.loop}-loop "
          f"at {cell.request_rate:.1f} req/s: TTFT p50 "
          f"{cell.ttft_ms.p50:.0f} ms, {cell.output_throughput:.0f} tok/s, hit rate {cell.hit_rate:.0%}, "
          f"{cell.failed} failed", file=sys.stderr)


async def _cell(running: systems.Running, model: str, run: Setup, plan: Plan) -> tuple[Cell, dict[str, float]]:
    sessions = workload(run.workload, plan)
    if run.loop == CLOSED:
        shape = load.Load(running.base_url, model, concurrency=plan.concurrency)
        starts = float("inf")
    else:  # sessions start at the rate that makes `run.rate` requests a second
        shape = load.Load(running.base_url, model, concurrency=plan.open_cap, rate=run.rate)
        starts = run.rate * len(sessions) / sum(len(turns) for turns in sessions)
    return await _run(running, shape, sessions, run, starts)


async def _run(running: systems.Running, shape: load.Load, sessions: list[list[Request]], run: Setup,
               starts_per_s: float = float("inf")) -> tuple[Cell, dict[str, float]]:
    timings, duration = await load.collect_sessions(shape, sessions, system=f"{run.workers} workers", quiet=True,
                                                    starts_per_s=starts_per_s)
    result = load.summarize(f"{run.workers} workers", shape, timings, duration)
    queried = hit = 0.0
    placed: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for url in (*running.worker_metrics_urls, *running.metrics_urls):
            text = (await http.get(url)).text
            queried += systems.sample(text, "tokenbus_worker_prefix_cache_queries_total")
            hit += systems.sample(text, "tokenbus_worker_prefix_cache_hits_total")
            for line in text.splitlines():
                if line.startswith("tokenbus_dispatch_decisions_total{"):
                    reason = line.split('reason="', 1)[1].split('"', 1)[0]
                    placed[reason] = placed.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    cell = Cell(run.workload, run.workers, run.dispatch, result.ttft_ms, tuple(t.ttft for t in timings if t.ok),
                result.output_throughput, hit / queried if queried else 0.0, result.requests, result.failed,
                result.request_throughput, run.loop)
    return cell, placed


@dataclass(frozen=True)
class RealPlan:
    """Two real CPU workers (vLLM on the default model), each with a KV cache that holds every prefix of the
    workload, so that what placement changes is where a prefix is prefilled first: once, or once per worker."""

    workers: int = 2
    prefixes: int = 16
    prefix_words: int = 300
    question_words: int = 8
    requests: int = 96
    concurrency: int = 4
    max_tokens: int = 4
    rounds: int = 2


def real_workload(plan: RealPlan, seed: int = 0) -> list[list[Request]]:
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded workload
    prefixes = [prompt_of(plan.prefix_words, rng) for _ in range(plan.prefixes)]
    return [[Request(f"{rng.choice(prefixes)} {prompt_of(plan.question_words, rng)}",
                     plan.prefix_words + plan.question_words, plan.max_tokens)] for _ in range(plan.requests)]


def measure_real(log: Path, engine: systems.Engine, plan: RealPlan) -> list[Cell]:
    """Cache-blind and cache-aware side by side, in rounds, each run on fresh processes: vLLM's own prefix cache
    counters give the hit rate."""
    cells = []
    for index in range(plan.rounds):
        for dispatch in DISPATCHES if index % 2 == 0 else tuple(reversed(DISPATCHES)):
            with systems.tokenbus(engine, log, workers=plan.workers, edge_settings={"dispatch": dispatch},
                                  worker_settings={"dispatch": dispatch}) as running:
                shape = load.Load(running.base_url, engine.model, concurrency=plan.concurrency)
                cell, _placed = asyncio.run(_run(running, shape, real_workload(plan),
                                                 Setup(SHARED, plan.workers, dispatch)))
            cells.append(cell)
            _progress(index, plan.rounds, cell)
    return cells
