"""Scale-out on the simulated engine: 1, 2 and 4 edges times 1, 2 and 4 workers against one Redis, each cell
on fresh processes. For each: streamed tokens per second, what the bus adds to the simulator's time to first
token, and Redis's own CPU (from its INFO) and commands per streamed token, to show where Redis saturates.

The load is streamed chat requests spread evenly over the edges, enough in flight to fill every worker's
slots. On a machine with few cores the processes share them with the load generator, so the figures show
where this machine saturates first; Redis's CPU per 1,000 tokens/s and its commands per token are the
figures that carry over to a bigger machine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from redis.cluster import RedisCluster

from services.bench import load, systems
from services.bench.client import Timing
from services.bench.stats import Summary
from services.bench.workload import Distribution, Request, requests
from services.supervisor import private_redis_cluster


@dataclass(frozen=True)
class Plan:
    edges: tuple[int, ...] = (1, 2, 4)
    workers: tuple[int, ...] = (1, 2, 4)
    slots_per_worker: int = 32
    """Each simulated worker's slots; the load keeps them all busy."""
    tokens: int = 64
    requests_per_slot: int = 4
    sim_ttft_ms: float = 50.0
    sim_itl_ms: float = 20.0
    backends: tuple[str, ...] = ("redis", "cluster")
    """One Redis, and a Redis Cluster of three masters."""

    @classmethod
    def quick(cls) -> Plan:
        return cls(edges=(1, 2), workers=(1, 2), slots_per_worker=8, tokens=16, requests_per_slot=2)


@dataclass(frozen=True)
class Cell:
    backend: str
    edges: int
    workers: int
    streams: int
    requests: int
    failed: int
    duration_s: float
    tokens_per_s: float
    ttft_overhead_ms: Summary
    """Time to first token minus the simulator's own."""
    redis_cpu_s: float
    redis_commands: int

    @property
    def redis_cores_per_1k_tokens_s(self) -> float:
        """The share of one core Redis spends for each 1,000 streamed tokens per second."""
        return (self.redis_cpu_s / self.duration_s) / max(self.tokens_per_s / 1000, 1e-9)

    @property
    def redis_commands_per_token(self) -> float:
        return self.redis_commands / max(self.tokens_per_s * self.duration_s, 1)


@dataclass(frozen=True)
class Result:
    plan: Plan
    cells: list[Cell] = field(default_factory=list)


def _nodes(url: str, cluster: bool) -> list[redis.Redis]:
    if not cluster:
        return [redis.Redis.from_url(url)]
    with RedisCluster.from_url(url) as nodes:
        return [redis.Redis(host=node.host, port=node.port) for node in nodes.get_primaries()]


def _redis_counters(url: str, cluster: bool) -> tuple[float, int]:
    """Redis's own CPU seconds (user and system, all its threads) and the commands it has processed, summed
    over a cluster's masters."""
    cpu_s, commands = 0.0, 0
    for client in _nodes(url, cluster):
        try:
            cpu, stats = client.info("cpu"), client.info("stats")
            cpu_s += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
            commands += int(stats["total_commands_processed"])
        finally:
            client.close()
    return cpu_s, commands


def _flush(url: str) -> None:
    """Empties a cluster between cells (a single Redis is a fresh one each time)."""
    for client in _nodes(url, True):
        try:
            client.flushall()
        finally:
            client.close()


def _wait_for_workers(metrics_url: str, model: str, workers: int, timeout_s: float = 60.0) -> None:
    """Until the edge sees every worker's heartbeat (the edge's live-workers gauge)."""
    deadline = time.monotonic() + timeout_s
    prefix = f'tokenbus_edge_live_workers{{model="{model}"}} '
    while time.monotonic() < deadline:
        text = httpx.get(metrics_url, timeout=5).text
        if any(line.startswith(prefix) and float(line.split()[-1]) >= workers for line in text.splitlines()):
            return
        time.sleep(0.25)
    raise RuntimeError(f"{workers} workers did not all beat within {timeout_s} s")


def measure_cell(engine: systems.Engine, log: Path, plan: Plan, edges: int, workers: int,
                 cluster_url: str | None = None) -> Cell:
    """One cell, on a fresh Redis, or on the given Redis Cluster (emptied first)."""
    streams = plan.slots_per_worker * workers
    cluster: dict[str, object] = {"redis_cluster": "true"} if cluster_url else {}
    if cluster_url:
        _flush(cluster_url)
    with systems.tokenbus(engine, log, sim=(plan.sim_ttft_ms, plan.sim_itl_ms), edges=edges, workers=workers,
                          worker_settings={"max_num_seqs": plan.slots_per_worker, **cluster}, edge_settings=cluster,
                          redis_url=cluster_url) as running:
        _wait_for_workers(running.metrics_urls[0], engine.model, workers)
        work = requests(streams * plan.requests_per_slot, Distribution("fixed", 16),
                        Distribution("uniform", plan.tokens // 2, plan.tokens * 3 // 2), seed=5)

        async def spread(batch: list[Request]) -> tuple[list[Timing], float]:
            """The requests dealt round-robin over the edges, each edge with its share of the streams."""
            shares = [[r for i, r in enumerate(batch) if i % edges == e] for e in range(edges)]
            started = time.perf_counter()
            runs = await asyncio.gather(*(
                load.collect(load.Load(url, engine.model, concurrency=max(1, streams // edges)), share,
                             system=f"{edges}x{workers}", quiet=True)
                for url, share in zip(running.base_urls, shares, strict=True)))
            return [t for timings, _duration in runs for t in timings], time.perf_counter() - started

        asyncio.run(spread(work[:streams]))  # warm-up: connections, the first wave
        cpu_before, commands_before = _redis_counters(running.redis_url, bool(cluster_url))
        timings, duration = asyncio.run(spread(work))
        cpu_after, commands_after = _redis_counters(running.redis_url, bool(cluster_url))
    done = [t for t in timings if t.ok]
    tokens = sum(t.output_tokens for t in done)
    ttft = Summary.of([t.ttft for t in done]).scaled(1000)
    return Cell("cluster" if cluster_url else "redis", edges, workers, streams, len(timings),
                len(timings) - len(done), duration, tokens / duration,
                Summary(ttft.mean - plan.sim_ttft_ms, ttft.p50 - plan.sim_ttft_ms, ttft.p90 - plan.sim_ttft_ms,
                        ttft.p99 - plan.sim_ttft_ms),
                cpu_after - cpu_before, commands_after - commands_before)


def measure(log: Path, plan: Plan, model: str) -> Result:
    engine = systems.Engine(model=model, model_dir=Path("."))
    result = Result(plan)
    for backend in plan.backends:
        if backend == "cluster":
            with private_redis_cluster(3) as url:
                _measure_cells(engine, log, plan, result, url)
        else:
            _measure_cells(engine, log, plan, result, None)
    return result


def _measure_cells(engine: systems.Engine, log: Path, plan: Plan, result: Result,
                   cluster_url: str | None) -> None:
    for workers in plan.workers:
        for edges in plan.edges:
            cell = measure_cell(engine, log, plan, edges, workers, cluster_url)
            print(f"  {cell.backend}: {edges} edges x {workers} workers: {cell.tokens_per_s:7.0f} tok/s, TTFT "
                  f"overhead p50 "
                  f"{cell.ttft_overhead_ms.p50:6.1f} ms p99 {cell.ttft_overhead_ms.p99:6.1f} ms, Redis "
                  f"{cell.redis_cores_per_1k_tokens_s:.3f} cores per 1k tok/s, {cell.redis_commands_per_token:.2f} "
                  f"commands/token, {cell.failed} failed")
            result.cells.append(cell)
