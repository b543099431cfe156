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
        f"Made by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on the machine above. Simulated workers with "
        f"{plan.slots} slots, a prefix cache of {plan.cache_blocks} "
        f"blocks of 16 words each (least recently used evicted first) and one prefill lane at "
        f"{plan.prefill_us_per_word:g} us a word (a {plan.prefix_words}-word prompt: "
        f"{plan.prefix_words * plan.prefill_us_per_word / 1000:.0f} ms uncached); TTFT {plan.sim_ttft_ms:.0f} ms, "
        f"ITL {plan.sim_itl_ms:.0f} ms, {plan.max_tokens} tokens an answer, {plan.concurrency} requests in flight. "
        f"Workloads: {cache.SHARED} ({plan.tenants} system prompts of {plan.prefix_words} words, each request one "
        f"of them and a {plan.question_words}-word question; a worker's cache holds "
        f"{plan.cache_blocks * 16 // plan.prefix_words} of them), {cache.MULTI_TURN} ({plan.conversations} "
        f"conversations of {plan.turns} turns, each turn {plan.turn_words} words more) and {cache.UNSHARED} "
        f"({plan.prefix_words + plan.question_words}-word prompts sharing nothing). Each cell runs cache-blind "
        "dispatch (`--dispatch blind`: any free worker) and cache-aware (`--dispatch aware`, the default, with its "
        "wait bound), one after the other on fresh processes. Hit rate: prompt words the workers' caches held, of "
        "those looked up. Aware/blind: time to first token p50, aware over blind, with its 95% bootstrap interval "
        "over the requests; output throughput is one figure per run (no interval).", "",
        "| workload | workers | TTFT p50 / p90 blind | aware | TTFT p50 aware/blind [95%] | output tok/s blind / aware "
        "| hit rate blind / aware | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for blind, aware in result.pairs():
        ratio = cache.ttft_ratio(blind, aware)
        lines.append(
            f"| {blind.workload} | {blind.workers} | {blind.ttft_ms.p50:.0f} / {blind.ttft_ms.p90:.0f} ms | "
            f"{aware.ttft_ms.p50:.0f} / {aware.ttft_ms.p90:.0f} ms | {ratio.estimate:.2f}x "
            f"[{ratio.low:.2f}, {ratio.high:.2f}] | {blind.output_throughput:.0f} / {aware.output_throughput:.0f} "
            f"({aware.output_throughput / blind.output_throughput if blind.output_throughput else 0:.2f}x) | "
            f"{blind.hit_rate:.0%} / {aware.hit_rate:.0%} | {blind.failed + aware.failed} |")
    lines += ["", "Placements of the aware runs (`tokenbus_dispatch_decisions_total`, edges and workers summed):", "",
              "| cell | cache | waited | expired | none |", "|---|---|---|---|---|"]
    for cell, placed in result.decisions.items():
        lines.append(f"| {cell} | " + " | ".join(f"{placed.get(reason, 0):.0f}"
                                                  for reason in ("cache", "waited", "expired", "none")) + " |")
    return [*lines, ""]


def real_section(cells: list[cache.Cell]) -> list[str]:
    """The two real workers' figures (none in a quick run)."""
    if not cells:
        return []
    plan = cache.RealPlan()
    by_dispatch = {cell.dispatch: cell for cell in cells}
    blind, aware = by_dispatch["blind"], by_dispatch["aware"]
    ratio = cache.ttft_ratio(blind, aware)
    return [
        f"With {plan.workers} real CPU workers (vLLM on the default model, its own prefix cache; the hit rate from its "
        f"counters): {plan.prefixes} system prompts of {plan.prefix_words} words, each request one of them and an "
        f"{plan.question_words}-word question, {plan.requests} requests, {plan.concurrency} in flight, "
        f"{plan.max_tokens} tokens an answer.", "",
        "| dispatch | TTFT p50 / p90 | output tok/s | prefix cache hit rate | failed |", "|---|---|---|---|---|",
        *(f"| {cell.dispatch} | {cell.ttft_ms.p50:.0f} / {cell.ttft_ms.p90:.0f} ms | {cell.output_throughput:.1f} | "
          f"{cell.hit_rate:.0%} | {cell.failed} |" for cell in (blind, aware)),
        "", f"TTFT p50 aware/blind: {ratio.estimate:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] (95% bootstrap "
            "interval over the requests).", ""]


def write(result: cache.Result, real: list[cache.Cell], path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    splice(path, HEADING, section(result, command) + real_section(real))
