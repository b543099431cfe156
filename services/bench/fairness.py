"""Fair share between tenants, FIFO against the fair-share scheduler, on the simulated engine: one edge with API
keys, one worker with 64 slots.

flood: tenant A keeps hundreds of streams in flight (each one that ends is replaced at once) while tenant B sends
one request at a time; B's time to first token is compared with B alone on the same processes. A's flood takes
three shapes: requests of one length (they start and end together, and the slots free in waves), of mixed lengths,
and of long prompts (prefill-heavy: the simulated engine's prefills share one lane).
weights: two tenants with weights 1 and 2 keep the worker saturated; their shares of the tokens served.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from services.bench import systems
from services.bench.client import Timing, send
from services.bench.stats import Summary
from services.bench.workload import Request, prompt_of
from shared.redisio import clients as redis_clients
from shared.runtime.settings import Settings
from shared.tenancy import apikeys, fairshare

SLOTS = 64
LOAD_TIMEOUT_S = 120.0
FLOODER, SIPPER, LIGHT, HEAVY = "tenant-a", "tenant-b", "light", "heavy"
SAME, MIXED, LONG = "same length", "mixed lengths", "long prompts"
FLOODS = (SAME, MIXED, LONG)
"""The shapes of A's flood; the run of each is named `flood: {shape}`."""
WEIGHTS = {FLOODER: 1.0, SIPPER: 1.0, LIGHT: 1.0, HEAVY: 2.0}

Measured = tuple[list[Timing], float, float]
"""A tenant's timings, and the window (perf_counter seconds) its figures are taken over."""


@dataclass(frozen=True)
class Plan:
    flood_streams: int = 300
    weighted_streams: int = 150
    """Per tenant of the weights scenario."""
    tokens: int = 32
    """Output tokens of B's requests; the others' vary around it (every prompt is 16 words)."""
    alone_requests: int = 20
    warmup_s: float = 3.0
    """Load before the measured window, so that the backlog is there when it opens."""
    window_s: float = 15.0
    sim_ttft_ms: float = 50.0
    sim_itl_ms: float = 20.0
    sim_prefill_us_per_token: float = 20.0
    """The simulated engine's prefill lane: B's 16 words cost it next to nothing, a long prompt a chunk or more."""
    long_prompt_words: int = 1024
    schedulers: tuple[str, ...] = ("fifo", "fair")

    @classmethod
    def quick(cls) -> Plan:
        return cls(flood_streams=200, weighted_streams=100, alone_requests=8, warmup_s=2.0, window_s=5.0)


@dataclass(frozen=True)
class TenantFigures:
    tenant: str
    weight: float
    requests: int
    """Requests sent in the measured window."""
    failed: int
    ttft_ms: Summary
    tokens: int
    """Tokens it received in the window."""
    share: float
    """Its part of all tokens received in the window."""


@dataclass(frozen=True)
class ScenarioFigures:
    """What one scenario measured under one scheduler."""

    scenario: str
    scheduler: str
    window_s: float
    """As measured: the flood's window ends when B's last request does."""
    tenants: dict[str, TenantFigures]


@dataclass(frozen=True)
class Result:
    plan: Plan
    scenarios: list[ScenarioFigures]

    def scenario(self, scenario: str, scheduler: str) -> ScenarioFigures:
        return next(r for r in self.scenarios if (r.scenario, r.scheduler) == (scenario, scheduler))


def measure(log: Path, plan: Plan) -> Result:
    """Both scenarios under each scheduler, on fresh processes per scheduler."""
    engine = systems.Engine(model="sim-model", model_dir=Path("."))
    runs: list[ScenarioFigures] = []
    for scheduler in plan.schedulers:
        with systems.tokenbus(engine, log, sim=(plan.sim_ttft_ms, plan.sim_itl_ms),
                              edge_settings={"auth": "keys", "scheduler": scheduler},
                              worker_settings={"max_num_seqs": SLOTS, "scheduler": scheduler,
                                               "sim_prefill_us_per_token": plan.sim_prefill_us_per_token}
                              ) as running:
            runs += asyncio.run(_scenarios(running, engine.model, scheduler, plan))
    return Result(plan, runs)


async def _scenarios(running: systems.Running, model: str, scheduler: str, plan: Plan) -> list[ScenarioFigures]:
    keys = await _keys(running.redis_url)
    request = Request(prompt_of(16, random.Random(0)), 16, plan.tokens)  # nosec B311: a benchmark's seeded workload
    url = running.base_url + "/v1/chat/completions"
    runs: list[ScenarioFigures] = []
    async with _session(keys[SIPPER]) as sipper:
        alone = (await _sequential(sipper, url, model, request, plan.alone_requests), 0.0, float("inf"))
        for shape in FLOODS:
            flood = await _flood(running, sipper, url, model, request, shape, keys[FLOODER], plan)
            runs.append(ScenarioFigures(f"flood: {shape}", scheduler, flood[SIPPER][2] - flood[SIPPER][1],
                            {**_figures({f"{SIPPER} alone": alone}), **_figures(flood)}))
    with Loads(url, model, request, {tenant: (keys[tenant], plan.weighted_streams) for tenant in (LIGHT, HEAVY)}
               ) as loads:
        await loads.ready()
        await asyncio.sleep(plan.warmup_s)
        await _backlogged(running.redis_url, model, 2 * plan.weighted_streams - SLOTS)
        opened = time.perf_counter()
        await asyncio.sleep(plan.window_s)
        closed = time.perf_counter()
        weights = {tenant: (timings, opened, closed) for tenant, timings in (await loads.stop()).items()}
    return [*runs, ScenarioFigures("weights", scheduler, closed - opened, _figures(weights))]


async def _flood(running: systems.Running, sipper: aiohttp.ClientSession, url: str, model: str, request: Request,
                 shape: str, key: str, plan: Plan) -> dict[str, Measured]:
    """B's requests one at a time while A keeps its flood of one shape in flight, over the measured window."""
    flooding = request
    if shape == LONG:
        flooding = Request(prompt_of(plan.long_prompt_words, random.Random(1)), plan.long_prompt_words,  # nosec B311: a benchmark's seeded workload
                           request.max_tokens)
    with Loads(url, model, flooding, {FLOODER: (key, plan.flood_streams)}, mixed=shape != SAME) as loads:
        await loads.ready()
        await asyncio.sleep(plan.warmup_s)
        await _backlogged(running.redis_url, model, plan.flood_streams - SLOTS)
        opened = time.perf_counter()
        sipped = await _sequential(sipper, url, model, request, 1 << 30, until=opened + plan.window_s)
        closed = time.perf_counter()
        return {SIPPER: (sipped, opened, closed), FLOODER: ((await loads.stop())[FLOODER], opened, closed)}


async def _keys(redis_url: str) -> dict[str, str]:
    redis = redis_clients.pooled(redis_url, "tokenbus-bench", 1)
    try:
        return {tenant: (await apikeys.create(redis, apikeys.KeyChanges(tenant=tenant, weight=weight)))[0]
                for tenant, weight in WEIGHTS.items()}
    finally:
        await redis.aclose()


async def _backlogged(redis_url: str, model: str, jobs: int) -> None:
    """Until nearly `jobs` jobs wait for a worker (a client process slowed down by the machine may take longer
    than the warm-up to get its requests out): the measured window must see the backlog."""
    redis = redis_clients.pooled(redis_url, "tokenbus-bench", 1)
    scheduler = fairshare.Scheduler(redis, Settings())
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    try:
        while await scheduler.queued(model) < 0.9 * jobs:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {jobs} jobs queued after {LOAD_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


def _session(key: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers={"Authorization": f"Bearer {key}"},
                                 timeout=aiohttp.ClientTimeout(total=600))


async def _sequential(session: aiohttp.ClientSession, url: str, model: str, request: Request, count: int,
                      until: float = float("inf")) -> list[Timing]:
    """One request at a time: `count` of them, or as many as start before `until` (perf_counter)."""
    timings: list[Timing] = []
    while len(timings) < count and time.perf_counter() < until:
        timings.append(await send(session, url, "chat", model, request))
    return timings


class Loads:
    """Tenants that keep `streams` requests in flight each, every one in a process of its own as separate
    clients would be (so that reading their streams does not delay the measured tenant's client)."""

    def __init__(self, url: str, model: str, request: Request, tenants: dict[str, tuple[str, int]],
                 mixed: bool = True) -> None:
        context = multiprocessing.get_context("spawn")
        self.started = context.Event()
        self.stopping = context.Event()
        self.results: multiprocessing.Queue[tuple[str, list[Timing]]] = context.Queue()
        self.processes = [context.Process(target=_load, name=f"load-{tenant}", args=(
            tenant, key, streams, url, model, request, mixed, self.started, self.stopping, self.results))
            for tenant, (key, streams) in tenants.items()]

    def __enter__(self) -> Loads:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stopping.set()
        for process in self.processes:
            process.join(LOAD_TIMEOUT_S)
            if process.is_alive():
                process.kill()

    async def ready(self) -> None:
        """Until every load has its first requests out."""
        if not await asyncio.to_thread(self.started.wait, LOAD_TIMEOUT_S):
            raise RuntimeError("the loads did not start")

    async def stop(self) -> dict[str, list[Timing]]:
        """Stops sending; each load's timings once its requests in flight have ended."""
        self.stopping.set()
        found = [await asyncio.to_thread(self.results.get, True, LOAD_TIMEOUT_S) for _ in self.processes]
        return dict(found)


def _load(tenant: str, key: str, streams: int, url: str, model: str, request: Request, mixed: bool, started: Any,
          stopping: Any, results: Any) -> None:
    """One load's process: `streams` requests in flight until `stopping`, each replaced as soon as it ends.
    Mixed, their lengths vary around the request's (half to one and a half times); else all have its length, and
    as they start together they end together: the worker's slots free in waves rather than one by one."""

    async def run() -> list[Timing]:
        timings: list[Timing] = []
        lengths = random.Random(tenant)  # nosec B311: a benchmark's seeded workload
        async with _session(key) as session:

            async def stream() -> None:
                while not stopping.is_set():
                    tokens = (lengths.randint(request.max_tokens // 2, request.max_tokens * 3 // 2) if mixed
                              else request.max_tokens)
                    timings.append(await send(session, url, "chat", model,
                                              Request(request.prompt, request.prompt_words, tokens)))

            running = [asyncio.create_task(stream()) for _ in range(streams)]
            started.set()
            await asyncio.gather(*running)
        return timings

    results.put((tenant, asyncio.run(run())))


def _figures(measured: dict[str, Measured]) -> dict[str, TenantFigures]:
    """Requests that began in the window, and tokens that arrived in it."""
    tokens = {tenant: sum(opened <= at <= closed for t in timings for at in t.content)
              for tenant, (timings, opened, closed) in measured.items()}
    total = sum(tokens.values()) or 1
    figures = {}
    for tenant, (timings, opened, closed) in measured.items():
        began = [t for t in timings if opened <= t.start <= closed]
        done = [t for t in began if t.ok]
        figures[tenant] = TenantFigures(
            tenant, WEIGHTS.get(tenant.split()[0], 1.0), len(began), len(began) - len(done),
            Summary.of([t.ttft for t in done]).scaled(1000), tokens[tenant], tokens[tenant] / total)
    return figures
