"""The edge and the bus alone, over the simulated engine: hop overhead, edge CPU per token, 2,000 streams."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.bench import bare as bare_server
from services.bench import load, systems
from services.bench.client import Timing
from services.bench.stats import Interval, Summary, bootstrap_mean, paired_bootstrap_ratio, percentile
from services.bench.workload import Distribution, requests


@dataclass(frozen=True)
class Overheads:
    """What one system adds to the simulator's own timings, as the load generator sees it."""

    ttft_ms: Summary
    """Over the requests after each round's first wave: `streams` in flight, arriving as others finish."""
    itl_ms: Summary
    first_wave_ttft_ms: Summary
    """Over each round's first `streams` requests, which all arrive in the same instant."""


@dataclass(frozen=True)
class HopResult:
    streams: int
    sim_ttft_ms: float
    sim_itl_ms: float
    tokenbus: Overheads
    bare: Overheads
    """The bus-less reference (services.bench.bare): the simulator inside a bare aiohttp handler, the floor
    that the load generator, HTTP and the timer grain set on this machine."""
    rounds: int
    pinned: bool = False
    """The load generator had a core of its own, the systems the others (see `pinned_apart`)."""
    added_ms: dict[str, Interval] = field(default_factory=dict)
    """Per round, tokenbus's percentile minus the bare server's of the same round; the mean over the rounds with its
    95% bootstrap interval: `ttft p50`, `ttft p99`, `first wave p50`."""
    cpu_us: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """CPU per request served, in us, per system and process, one figure per round: tokenbus's `edge`, `worker`
    and `redis-server`, the bare server's `bare`. Every process's own time (children not included), first wave,
    steady state and every token streamed alike."""

    def cpu_total(self, system: str) -> list[float]:
        """A system's CPU per request in each round, over all its processes."""
        parts = self.cpu_us.get(system, {})
        return [sum(figures) for figures in zip(*parts.values(), strict=True)]

    def cpu_ratio(self) -> Interval | None:
        """tokenbus's CPU per request over the bare server's, paired by round, with its interval."""
        if not self.cpu_us:
            return None
        return paired_bootstrap_ratio(self.cpu_total("tokenbus"), self.cpu_total("bare"))


@dataclass(frozen=True)
class EdgeThroughput:
    streams: int
    tokens: int
    tokens_per_s: float
    edge_cpu_s: float
    edge_cpu_us_per_token: float
    edge_kernel_share: float
    """The part of the edge's CPU time spent in the kernel (socket writes, loopback TCP)."""
    client_cpu_bound: bool


@dataclass(frozen=True)
class ManyStreams:
    streams: int
    completed: int
    edge_redis_connections_max: int
    edge_rss_mib_max: float
    e2e_ms: Summary


def _edge_connections(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(1 for c in client.client_list() if str(c.get("name", "")).startswith("tokenbus-edge-"))
    finally:
        client.close()


def can_pin() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


@contextlib.contextmanager
def pinned_apart(pin: bool) -> Iterator[Callable[[], None]]:
    """With `pin`, everything started in the block runs on every core but the last, and the calling process (the
    load generator) moves to the last once it calls the function the block gets: so the generator's HTTP
    client is not counted as the bus, and does not take the system's CPU. Affinity is put back after."""
    cores = sorted(os.sched_getaffinity(0))
    if pin:
        os.sched_setaffinity(0, cores[:-1])  # processes started now inherit it
    try:
        yield (lambda: os.sched_setaffinity(0, cores[-1:])) if pin else (lambda: None)
    finally:
        os.sched_setaffinity(0, cores)


def hop_overhead(engine: systems.Engine, log: Path, streams: int = 64, ttft_ms: float = 50.0,
                 itl_ms: float = 20.0, tokens: int = 64, pin: bool = False, rounds: int = 6) -> HopResult:
    """What edge -> Redis -> worker -> Redis -> edge adds to the simulator's own timings, side by side with the
    bus-less reference over the same simulator: both up at once, in `rounds` rounds that alternate their order,
    each a first wave of `streams` requests sent in the same instant and then 3 x `streams` more. With `pin`, the
    load generator runs on a core of its own."""
    pin = pin and can_pin()
    # varied lengths, so that streams do not all start in the same instant as fixed lengths would make them
    work = requests(streams * 4, Distribution("fixed", 32), Distribution("uniform", tokens // 2, tokens * 3 // 2),
                    seed=1)
    timings: dict[str, list[tuple[list[Timing], list[Timing]]]] = {"tokenbus": [], "bare": []}
    cpu_us: dict[str, dict[str, list[float]]] = {"tokenbus": {}, "bare": {}}
    with pinned_apart(pin) as move_load, systems.tokenbus(engine, log, sim=(ttft_ms, itl_ms)) as running, \
            systems.bare(log, sim=(ttft_ms, itl_ms)) as bare:
        move_load()
        pids = {"tokenbus": {"edge": running.pids["edge"], "worker": running.pids["worker"],
                             "redis-server": systems.redis_pid(running.redis_url)},
                "bare": {"bare": bare.pids["bare"]}}
        shapes = {"tokenbus": load.Load(running.base_url, engine.model, concurrency=streams),
                  "bare": load.Load(bare.base_url, bare_server.MODEL, concurrency=streams)}
        for shape in shapes.values():
            asyncio.run(load.run(shape, work[:streams], system="warm-up", quiet=True))
        for number in range(rounds):
            for system in sorted(shapes, reverse=number % 2 == 1):
                before = {part: systems.cpu_reading(pid) for part, pid in pids[system].items()}
                measured, _duration = asyncio.run(load.collect(shapes[system], work, system=system, quiet=True))
                after = {part: systems.cpu_reading(pid) for part, pid in pids[system].items()}
                ok = sorted((t for t in measured if t.ok), key=lambda t: t.start)
                timings[system].append((ok[:streams], ok[streams:]))
                for part in pids[system]:
                    cpu_us[system].setdefault(part, []).append(
                        after[part].seconds_since(before[part]) / max(len(ok), 1) * 1e6)
    return HopResult(streams, ttft_ms, itl_ms, rounds=rounds, pinned=pin, added_ms=_added(timings), cpu_us=cpu_us,
                     **{system: _overheads(runs, ttft_ms, itl_ms) for system, runs in timings.items()})


def _added(timings: dict[str, list[tuple[list[Timing], list[Timing]]]]) -> dict[str, Interval]:
    """tokenbus - bare, round by round (both ran side by side in it), as a mean over the rounds with its interval:
    the noise between rounds on a shared machine is as large as the figure."""
    def added(pick: Callable[[tuple[list[Timing], list[Timing]]], list[float]], q: float) -> Interval:
        return bootstrap_mean([1000 * (percentile(pick(mine), q) - percentile(pick(floor), q))
                               for mine, floor in zip(timings["tokenbus"], timings["bare"], strict=True)])

    def steady(run: tuple[list[Timing], list[Timing]]) -> list[float]:
        return [t.ttft for t in run[1]]

    def wave(run: tuple[list[Timing], list[Timing]]) -> list[float]:
        return [t.ttft for t in run[0]]

    return {"ttft p50": added(steady, 50), "ttft p99": added(steady, 99), "first wave p50": added(wave, 50)}


def _overheads(runs: list[tuple[list[Timing], list[Timing]]], ttft_ms: float, itl_ms: float) -> Overheads:
    first_wave = [t for wave, _steady in runs for t in wave]
    steady = [t for _wave, rest in runs for t in rest]
    return Overheads(ttft_ms=_overhead([t.ttft for t in steady], ttft_ms),
                     itl_ms=_overhead([i for t in steady for i in t.itls], itl_ms),
                     first_wave_ttft_ms=_overhead([t.ttft for t in first_wave], ttft_ms))


def _overhead(seconds: list[float], base_ms: float) -> Summary:
    summary = Summary.of(seconds).scaled(1000)
    return Summary(summary.mean - base_ms, summary.p50 - base_ms, summary.p90 - base_ms, summary.p99 - base_ms)


def edge_throughput(engine: systems.Engine, log: Path, streams: int = 256, tokens: int = 256,
                    itl_ms: float = 10.0) -> EdgeThroughput:
    """As many streamed tokens as one edge passes, and the edge's CPU time for each."""
    with systems.tokenbus(engine, log, sim=(10.0, itl_ms)) as running:
        edge_pid = running.pids["edge"]
        shape = load.Load(running.base_url, engine.model, concurrency=streams)
        work = requests(streams, Distribution("fixed", 16), Distribution("fixed", tokens), seed=2)
        asyncio.run(load.run(shape, work[:16], system="warm-up", quiet=True))
        (user_before, kernel_before), started = systems.cpu_times(edge_pid), time.process_time()
        result = asyncio.run(load.run(shape, work, system="edge-throughput"))
        user, kernel = (after - before for after, before in zip(systems.cpu_times(edge_pid),
                                                                 (user_before, kernel_before), strict=True))
        client_cpu = time.process_time() - started
    total = round(result.output_throughput * result.duration_s)
    edge_cpu = user + kernel
    return EdgeThroughput(streams, total, result.output_throughput, edge_cpu, edge_cpu / max(total, 1) * 1e6,
                          edge_kernel_share=kernel / edge_cpu if edge_cpu else 0.0,
                          client_cpu_bound=client_cpu > 0.8 * result.duration_s)


def many_streams(engine: systems.Engine, log: Path, streams: int = 2000, tokens: int = 40,
                 itl_ms: float = 100.0) -> ManyStreams:
    """One edge holding `streams` open streams at once, with its Redis connections and memory sampled."""
    with systems.tokenbus(engine, log, sim=(50.0, itl_ms)) as running:
        shape = load.Load(running.base_url, engine.model, concurrency=streams, timeout_s=300)
        work = requests(streams, Distribution("fixed", 8), Distribution("fixed", tokens), seed=3)
        peak = {"connections": 0, "rss": 0.0}

        async def sample() -> None:
            while True:
                peak["connections"] = max(peak["connections"], _edge_connections(running.redis_url))
                peak["rss"] = max(peak["rss"], systems.rss_mib(running.pids["edge"]))
                await asyncio.sleep(0.5)

        async def go() -> load.Result:
            sampler = asyncio.create_task(sample())
            try:
                return await load.run(shape, work, system="2000-streams")
            finally:
                sampler.cancel()

        result = asyncio.run(go())
    return ManyStreams(streams, result.requests - result.failed, int(peak["connections"]), float(peak["rss"]),
                       result.e2e_ms)
