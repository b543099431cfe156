"""Runs a load against a server and turns the timings into the figures a serving engineer reads."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import aiohttp

from services.bench.client import Timing, send
from services.bench.stats import Summary
from services.bench.workload import Request, poisson_gaps

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class Load:
    base_url: str
    model: str
    api: str = "chat"
    concurrency: int = 8
    rate: float = float("inf")
    """Requests per second of a Poisson process; inf sends as fast as the concurrency allows."""
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0
    timeout_s: float = 600.0
    extra_base_urls: tuple[str, ...] = ()
    """Further edges of the same deployment: requests are dealt round-robin over `base_url` and these."""

    @property
    def urls(self) -> list[str]:
        return [url.rstrip("/") + PATHS[self.api] for url in (self.base_url, *self.extra_base_urls)]


@dataclass(frozen=True)
class Result:
    system: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float
    ttft_ms: Summary
    ttfc_ms: Summary
    itl_ms: Summary
    tpot_ms: Summary
    e2e_ms: Summary
    first_error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(system: str, load: Load, timings: list[Timing], duration_s: float) -> Result:
    done = [t for t in timings if t.ok]
    tpots = [t.tpot for t in done if t.tpot is not None]
    good = [t for t in done if t.ttft * 1000 <= load.slo_ttft_ms and (t.tpot or 0) * 1000 <= load.slo_tpot_ms]
    errors = [t.error for t in timings if t.error]
    return Result(
        system=system, concurrency=load.concurrency, requests=len(timings), failed=len(timings) - len(done),
        duration_s=duration_s, request_throughput=len(done) / duration_s,
        output_throughput=sum(t.output_tokens for t in done) / duration_s, goodput=len(good) / duration_s,
        ttft_ms=Summary.of([t.ttft for t in done]).scaled(1000),
        ttfc_ms=Summary.of([t.ttfc for t in done]).scaled(1000),
        itl_ms=Summary.of([i for t in done for i in t.itls]).scaled(1000),
        tpot_ms=Summary.of(tpots).scaled(1000),
        e2e_ms=Summary.of([t.latency for t in done]).scaled(1000),
        first_error=errors[0] if errors else None,
    )


async def _progress(label: str, timings: list[Timing], total: int) -> None:
    started = time.monotonic()
    while True:
        await asyncio.sleep(2.0)
        print(f"  {label}: {len(timings)}/{total} done, {time.monotonic() - started:.0f} s", file=sys.stderr)


async def run(load: Load, requests: list[Request], *, system: str = "server", seed: int = 0,
              quiet: bool = False) -> Result:
    """Sends every request (at most `concurrency` at once, arriving as a Poisson process) and summarizes."""
    timings, duration = await collect(load, requests, system=system, seed=seed, quiet=quiet)
    return summarize(system, load, timings, duration)


async def collect(load: Load, requests: list[Request], *, system: str = "server", seed: int = 0,
                  quiet: bool = False) -> tuple[list[Timing], float]:
    """Like `run`, and gives each request's timing (in the order they finished) and the duration."""
    return await _collect(load, [[request] for request in requests], poisson_gaps(load.rate, seed), system, quiet)


async def collect_sessions(load: Load, sessions: list[list[Request]], *, system: str = "server",
                           quiet: bool = False, starts_per_s: float = float("inf"),
                           seed: int = 0) -> tuple[list[Timing], float]:
    """Conversations: each session's requests one after the other (the next once the last one's answer came, as
    a user or an agent sends its next turn), the sessions side by side, starting as a Poisson process of
    `starts_per_s` (inf: all at once), at most `concurrency` requests at once. Gives each request's timing and the
    duration."""
    return await _collect(load, sessions, poisson_gaps(starts_per_s, seed), system, quiet)


async def _collect(load: Load, sessions: list[list[Request]], gaps: Iterable[float], system: str,
                   quiet: bool) -> tuple[list[Timing], float]:
    urls = load.urls
    gate = asyncio.Semaphore(load.concurrency)
    timings: list[Timing] = []
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def converse(turns: list[Request], url: str) -> None:
            for request in turns:
                async with gate:
                    timings.append(await send(session, url, load.api, load.model, request))

        label = f"{system} c={load.concurrency}"
        total = sum(len(turns) for turns in sessions)
        reporter = None if quiet else asyncio.create_task(_progress(label, timings, total))
        started = time.perf_counter()
        tasks = []
        for number, (turns, gap) in enumerate(zip(sessions, gaps, strict=False)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(converse(turns, urls[number % len(urls)])))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        if reporter is not None:
            reporter.cancel()
    return timings, duration
