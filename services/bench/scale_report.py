"""The scale-out section of docs/benchmarks.md, from what `tokenbus bench scale` measured."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from services.bench import scale
from services.bench.report import splice

SCALE_HEADING = "## Scale-out: edges and workers on one Redis (simulated engine)"


def scale_section(result: scale.Result, command: str) -> list[str]:
    plan = result.plan
    lines = [
        SCALE_HEADING, "",
        f"Made by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on a machine with {os.cpu_count()} cores "
        f"that every process of a cell shares with the load generator. Each cell runs on fresh processes: one "
        f"Redis, simulated workers of {plan.slots_per_worker} slots each (TTFT {plan.sim_ttft_ms:.0f} ms, ITL "
        f"{plan.sim_itl_ms:.0f} ms), edges without keys; {plan.requests_per_slot} streamed chat requests per slot "
        f"of {plan.tokens // 2} to {plan.tokens * 3 // 2} tokens, dealt evenly over the edges, enough in flight to "
        "fill every slot. TTFT overhead is the time to first token less the simulator's own. Redis's CPU comes "
        "from its INFO (all its threads; summed over a cluster's masters, which share the same cores), its "
        "commands from `total_commands_processed`. The cluster's three masters run on this machine too, and are "
        "emptied between cells.", "",
        "| Redis | edges | workers | streams | tokens/s | TTFT overhead p50 / p99 | Redis cores per 1,000 tokens/s "
        "| Redis commands per token | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"redis": "one", "cluster": "cluster (3 masters)"}
    for cell in result.cells:
        lines.append(
            f"| {names[cell.backend]} | {cell.edges} | {cell.workers} | {cell.streams} | {cell.tokens_per_s:.0f} | "
            f"{cell.ttft_overhead_ms.p50:.1f} / {cell.ttft_overhead_ms.p99:.1f} ms | "
            f"{cell.redis_cores_per_1k_tokens_s:.3f} | {cell.redis_commands_per_token:.2f} | {cell.failed} |")
    return [*lines, ""]


def write(result: scale.Result, path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    splice(path, SCALE_HEADING, scale_section(result, command))
