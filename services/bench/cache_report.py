"""The prefix cache section of docs/benchmarks.md, from what `tokenbus bench cache` measured."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from services.bench import cache
from services.bench.report import splice

HEADING = "## Dispatch and the prefix cache (simulated engine)"


def section(result: cache.Result, command: str) -> list[str]:
    plan = result.plan
    lines = [
        HEADING, "",
        f"Made by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on the machine above; dispatch: "
        f"**{result.dispatch}**. Simulated workers with {plan.slots} slots, a prefix cache of {plan.cache_blocks} "
        f"blocks of 16 words each (least recently used evicted first) and one prefill lane at "
        f"{plan.prefill_us_per_word:g} us a word (a {plan.prefix_words}-word prompt: "
        f"{plan.prefix_words * plan.prefill_us_per_word / 1000:.0f} ms uncached); TTFT {plan.sim_ttft_ms:.0f} ms, "
        f"ITL {plan.sim_itl_ms:.0f} ms, {plan.max_tokens} tokens an answer, {plan.concurrency} requests in flight. "
        f"Workloads: {cache.SHARED} ({plan.tenants} system prompts of {plan.prefix_words} words, each request one "
        f"of them and a {plan.question_words}-word question; a worker's cache holds "
        f"{plan.cache_blocks * 16 // plan.prefix_words} of them), {cache.MULTI_TURN} ({plan.conversations} "
        f"conversations of {plan.turns} turns, each turn {plan.turn_words} words more) and {cache.UNSHARED} "
        f"({plan.prefix_words + plan.question_words}-word prompts sharing nothing). Hit rate: prompt words the "
        "workers' caches held, of those looked up.", "",
        "| workload | workers | TTFT p50 / p90 | output tok/s | hit rate | requests | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in result.cells:
        lines.append(f"| {cell.workload} | {cell.workers} | {cell.ttft_ms.p50:.0f} / {cell.ttft_ms.p90:.0f} ms | "
                     f"{cell.output_throughput:.0f} | {cell.hit_rate:.0%} | {cell.requests} | {cell.failed} |")
    return [*lines, ""]


def write(result: cache.Result, path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    splice(path, HEADING, section(result, command))
