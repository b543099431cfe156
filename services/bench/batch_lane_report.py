"""The batch lane's section of docs/benchmarks.md, from what `tokenbus bench batch` measured."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from services.bench import batch_lane
from services.bench.report import splice

HEADING = "## The batch lane: interactive work while a batch runs (simulated engine)"


def section(result: batch_lane.Result, command: str) -> list[str]:
    plan = result.plan
    alone, during = result.alone_ms, result.during_ms
    return [
        HEADING, "",
        f"Made by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on the machine above. One edge, one "
        f"simulated worker with {batch_lane.SLOTS} slots (TTFT {plan.sim_ttft_ms:.0f} ms, ITL "
        f"{plan.sim_itl_ms:.0f} ms). A batch of {plan.lines:,} chat lines ({plan.line_tokens} tokens each) is "
        "uploaded and created through the Files and Batch APIs; an interactive client sends one streamed chat "
        f"request ({plan.tokens} tokens) at a time, first alone, then for {plan.window_s:.0f} s while the batch "
        f"runs ({plan.warmup_s:.0f} s after it began), on the same processes. The batch is cancelled after the "
        "window: its rate is the figure, not its end.", "",
        "| interactive TTFT | p50 | p90 | p99 | requests |", "|---|---|---|---|---|",
        f"| alone | {alone.p50:.0f} ms | {alone.p90:.0f} ms | {alone.p99:.0f} ms | {plan.alone_requests} |",
        f"| while the batch runs | {during.p50:.0f} ms | {during.p90:.0f} ms | {during.p99:.0f} ms "
        f"| {result.requests_during} |", "",
        f"p50 while the batch runs / alone: **{result.ratio:.2f}x**. The batch answered "
        f"{result.lines_per_s:.0f} lines/s over the window ({result.lines_done:,} of {plan.lines:,} lines by its "
        f"end; the batch was {result.batch_status}); failed interactive requests: {result.failed}.", "",
    ]


def write(result: batch_lane.Result, path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    splice(path, HEADING, section(result, command))
