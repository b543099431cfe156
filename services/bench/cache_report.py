"""The prefix cache section of docs/benchmarks.md, from what `tokenbus bench cache` measured."""

from __future__ import annotations

import statistics
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
        f"ITL {plan.sim_itl_ms:.0f} ms, {plan.max_tokens} tokens an answer. "
        f"Workloads: {cache.SHARED} ({plan.tenants} system prompts of {plan.prefix_words} words, each request one "
        f"of them and a {plan.question_words}-word question; a worker's cache holds "
        f"{plan.cache_blocks * 16 // plan.prefix_words} of them), {cache.MULTI_TURN} ({plan.conversations} "
        f"conversations of {plan.turns} turns, each turn {plan.turn_words} words more, sent once the last one's "
        f"answer came) and {cache.UNSHARED} "
        f"({plan.prefix_words + plan.question_words}-word prompts sharing nothing). Each cell runs cache-blind "
        "dispatch (`--dispatch blind`: any free worker) and cache-aware (`--dispatch aware`, the default, with its "
        f"wait bound), side by side on fresh processes, in {plan.rounds} rounds (which of the two runs first "
        "alternating). Hit rate: prompt words the workers' caches held, of those looked up (mean of the rounds). "
        "TTFT: over every round's requests. Aware/blind: time to first token p50, aware over blind, with its 95% "
        "interval from a two-level bootstrap (rounds, then each run's requests), and each round's own ratio; output "
        "throughput: the median of the rounds' runs.", "",
        f"**Closed loop**, {plan.concurrency} requests in flight (each sent once one ends): what each dispatch "
        "serves, and a time to first token set by that many requests queued at the workers' prefill lanes.", "",
        "| workload | workers | TTFT p50 / p90 blind | aware | TTFT p50 aware/blind [95%] | by round "
        "| output tok/s blind / aware | hit rate blind / aware | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in result.pairs():
        lines.append(_row(pair))
    lines += ["", f"**Open loop**: requests (a conversation's first turn) arriving as a Poisson process at "
              f"{plan.open_load:.0%} of the requests a second blind dispatch served in the same round's closed-loop "
              "run of the cell, a load it sustains; a conversation's next turn sent once the last one's answer came; "
              "time to first token at the same offered load for both dispatches.", "",
              "| workload | workers | answered req/s blind / aware | TTFT p50 / p90 blind | aware | "
              "TTFT p50 aware/blind [95%] | by round | hit rate blind / aware | failed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for pair in result.pairs(cache.OPEN):
        lines.append(_open_row(pair))
    lines += ["", "Placements of the aware runs (`tokenbus_dispatch_decisions_total`, edges and workers, summed over "
              "the rounds):", "",
              "| cell | cache | waited | expired | none |", "|---|---|---|---|---|"]
    for cell, placed in result.decisions.items():
        lines.append(f"| {cell} | " + " | ".join(f"{placed.get(reason, 0):.0f}"
                                                  for reason in ("cache", "waited", "expired", "none")) + " |")
    return [*lines, ""]


def _row(pair: cache.Pair) -> str:
    blind, aware = cache.pooled_ttft_ms(pair.blind), cache.pooled_ttft_ms(pair.aware)
    ratio = pair.ttft_ratio()
    served = cache.median_throughput(pair.blind), cache.median_throughput(pair.aware)
    failed = sum(cell.failed for cell in (*pair.blind, *pair.aware))
    return (f"| {pair.workload} | {pair.workers} | {blind.p50:.0f} / {blind.p90:.0f} ms | {aware.p50:.0f} / "
            f"{aware.p90:.0f} ms | {ratio.estimate:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] | "
            f"{', '.join(f'{r:.2f}' for r in pair.round_ratios())} | {served[0]:.0f} / {served[1]:.0f} "
            f"({served[1] / served[0] if served[0] else 0:.2f}x) | {cache.mean_hit_rate(pair.blind):.0%} / "
            f"{cache.mean_hit_rate(pair.aware):.0%} | {failed} |")


def _open_row(pair: cache.Pair) -> str:
    blind, aware = cache.pooled_ttft_ms(pair.blind), cache.pooled_ttft_ms(pair.aware)
    ratio = pair.ttft_ratio()
    rates = [statistics.median(cell.request_rate for cell in runs) for runs in (pair.blind, pair.aware)]
    failed = sum(cell.failed for cell in (*pair.blind, *pair.aware))
    return (f"| {pair.workload} | {pair.workers} | {rates[0]:.1f} / {rates[1]:.1f} | {blind.p50:.0f} / "
            f"{blind.p90:.0f} ms | {aware.p50:.0f} / {aware.p90:.0f} ms | {ratio.estimate:.2f}x [{ratio.low:.2f}, "
            f"{ratio.high:.2f}] | {', '.join(f'{r:.2f}' for r in pair.round_ratios())} | "
            f"{cache.mean_hit_rate(pair.blind):.0%} / {cache.mean_hit_rate(pair.aware):.0%} | {failed} |")


def real_section(cells: list[cache.Cell]) -> list[str]:
    """The two real workers' figures (none in a quick run)."""
    if not cells:
        return []
    plan = cache.RealPlan()
    pair = cache.pair_up(cells)[0]
    ratio = pair.ttft_ratio()
    return [
        f"With {plan.workers} real CPU workers (vLLM on the default model, its own prefix cache; the hit rate from its "
        f"counters): {plan.prefixes} system prompts of {plan.prefix_words} words, each request one of them and an "
        f"{plan.question_words}-word question, {plan.requests} requests, {plan.concurrency} in flight, "
        f"{plan.max_tokens} tokens an answer; {plan.rounds} rounds.", "",
        "| dispatch | TTFT p50 / p90 | output tok/s | prefix cache hit rate | failed |", "|---|---|---|---|---|",
        *(f"| {name} | {summary.p50:.0f} / {summary.p90:.0f} ms | {cache.median_throughput(runs):.1f} | "
          f"{cache.mean_hit_rate(runs):.0%} | {sum(cell.failed for cell in runs)} |"
          for name, runs in (("blind", pair.blind), ("aware", pair.aware))
          for summary in (cache.pooled_ttft_ms(runs),)),
        "", f"TTFT p50 aware/blind: {ratio.estimate:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] (95%, two-level "
            f"bootstrap), by round {', '.join(f'{r:.2f}' for r in pair.round_ratios())}.", ""]


def write(result: cache.Result, real: list[cache.Cell], path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    splice(path, HEADING, section(result, command) + real_section(real))
