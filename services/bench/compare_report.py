"""The tokenbus-against-`vllm serve` section of docs/benchmarks.md: mean figures per system, and the ratios
with their bootstrap intervals and verdicts, from what `compare.compare` measured."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from services.bench.compare import (
    BASELINES,
    FOUR_EDGES,
    VLLM_SERVE,
    VLLM_SERVE_2,
    Cell,
    Comparison,
    Idle,
    Shape,
    idle_totals,
)
from services.bench.stats import LEAD, LOSS, MIN_ROUNDS, Interval, paired_bootstrap_ratio, verdict
from services.bench.systems import Engine
from services.bench.workload import Distribution

HEADING = "## tokenbus against `vllm serve`"
GPU_HEADING = "## tokenbus against `vllm serve` on an NVIDIA GPU"
"""The same comparison run where the engines had a GPU: a section of its own, so that a run on either kind of
machine keeps the other's figures."""


def heading(engine: Engine) -> str:
    return HEADING if engine.gpu is None else GPU_HEADING


RESAMPLES = 4000


@dataclass(frozen=True)
class Metric:
    label: str
    of: Callable[[Cell], float]
    higher_is_better: bool


RATIO_METRICS = (
    Metric("output throughput", lambda c: c.result.output_throughput, True),
    Metric("TTFT p50", lambda c: c.result.ttft_ms.p50, False),
    Metric("TPOT p50", lambda c: c.result.tpot_ms.p50, False),
    Metric("front-end CPU per token", lambda c: c.front_cpu_us_per_token, False),
    Metric("front end's share of TTFT", lambda c: c.front_ttft_ms, False),
)


@dataclass(frozen=True)
class Ratio:
    """One system's figure over `vllm serve`'s in the same shape, over the rounds."""

    metric: Metric
    interval: Interval

    @property
    def verdict(self) -> str:
        return verdict(self.interval, self.metric.higher_is_better)


@dataclass(frozen=True)
class RatioRow:
    """A tokenbus `system` over a `baseline` (a `vllm serve`) in one shape, each metric's ratio."""

    shape: Shape
    system: str
    baseline: str
    ratios: list[Ratio]


def ratios(comparison: Comparison) -> list[RatioRow]:
    """Every tokenbus variant against every `vllm serve` the shape ran on, shape by shape, each metric's ratio."""
    rows = []
    for shape, by_system in comparison.items():
        for baseline in (b for b in BASELINES if b in by_system):
            theirs = by_system[baseline]
            for system, ours in by_system.items():
                if system not in BASELINES:
                    rows.append(RatioRow(shape, system, baseline, [Ratio(metric, paired_bootstrap_ratio(
                        [metric.of(c) for c in ours], [metric.of(c) for c in theirs], resamples=RESAMPLES))
                        for metric in RATIO_METRICS]))
    return rows


def _mean(cells: list[Cell], of: Callable[[Cell], float]) -> float:
    return statistics.mean(of(cell) for cell in cells)


MEAN_COLUMNS: tuple[tuple[str, Callable[[Cell], float], str], ...] = (
    ("output tok/s", lambda c: c.result.output_throughput, "{:.1f}"),
    ("req/s", lambda c: c.result.request_throughput, "{:.2f}"),
    ("TTFT p50", lambda c: c.result.ttft_ms.p50, "{:.0f} ms"),
    ("TTFT p99", lambda c: c.result.ttft_ms.p99, "{:.0f} ms"),
    ("TTFT, front end's share", lambda c: c.front_ttft_ms, "{:.0f} ms"),
    ("ITL p50", lambda c: c.result.itl_ms.p50, "{:.1f} ms"),
    ("ITL p99", lambda c: c.result.itl_ms.p99, "{:.1f} ms"),
    ("TPOT p50", lambda c: c.result.tpot_ms.p50, "{:.1f} ms"),
    ("E2E p50", lambda c: c.result.e2e_ms.p50, "{:.0f} ms"),
    ("goodput req/s", lambda c: c.result.goodput, "{:.2f}"),
    ("front-end CPU per token", lambda c: c.front_cpu_us_per_token, "{:.0f} us"),
    ("engine CPU per token", lambda c: c.engine_cpu_us_per_token, "{:.0f} us"),
)
"""The per-system table: each column's heading, figure of one cell, and format of its mean over the rounds."""


def means_table(comparison: Comparison) -> list[str]:
    lines = ["| shape | streams | system | " + " | ".join(c[0] for c in MEAN_COLUMNS) + " | failed |",
             "|---|---|---|" + "---|" * (len(MEAN_COLUMNS) + 1)]
    for shape, by_system in comparison.items():
        for system, cells in by_system.items():
            figures = " | ".join(fmt.format(_mean(cells, of)) for _, of, fmt in MEAN_COLUMNS)
            lines.append(f"| {shape.name} | {shape.concurrency} | {system} | {figures} "
                         f"| {sum(c.result.failed for c in cells)} |")
    return lines


def _ratio_text(ratio: Ratio) -> str:
    return _interval_text(ratio.interval, ratio.verdict)


def _interval_text(i: Interval, said: str) -> str:
    word = f"**{said}**" if said in (LEAD, LOSS) else said
    return f"{i.estimate:.3f}x [{i.low:.3f}, {i.high:.3f}] {word}"


def ratio_table(comparison: Comparison) -> list[str]:
    lines = ["| shape | streams | system | " + " | ".join(m.label for m in RATIO_METRICS) + " |",
             "|---|---|---|" + "---|" * len(RATIO_METRICS)]
    for row in ratios(comparison):
        lines.append(f"| {row.shape.name} | {row.shape.concurrency} | {row.system} / {row.baseline} | "
                     + " | ".join(_ratio_text(ratio) for ratio in row.ratios) + " |")
    return lines


def idle_table(idle: Idle) -> list[str]:
    """Each system's front-end CPU while idle, and its ratio to `vllm serve`'s with its interval."""
    theirs = idle.get(VLLM_SERVE)
    lines = ["| system | front-end CPU while idle | / vllm serve |", "|---|---|---|"]
    for system, rounds in idle.items():
        ours, ratio = idle_totals(rounds), ""
        if theirs is not None and system not in BASELINES:
            interval = paired_bootstrap_ratio(ours, idle_totals(theirs), resamples=RESAMPLES)
            ratio = _interval_text(interval, verdict(interval, higher_is_better=False))
        lines.append(f"| {system} | {statistics.mean(ours):.2f} ms/s | {ratio} |")
    return lines


def _parts_text(figures: dict[str, float], fmt: str) -> str:
    parts = [f"{part} {fmt.format(value)}" for part, value in figures.items()]
    return " + ".join(parts) + (f" = {fmt.format(sum(figures.values()))}" if len(parts) > 1 else "")


def breakdown_table(comparison: Comparison, idle: Idle) -> list[str]:
    """Each system's front-end CPU per token by process (mean over the rounds) in every shape, and while idle."""
    shapes = list(comparison)
    systems = list(dict.fromkeys(system for by_system in comparison.values() for system in by_system))
    lines = ["| system | " + " | ".join(f"{shape.name} c={shape.concurrency}, us/token" for shape in shapes)
             + (" | idle, ms/s |" if idle else " |"),
             "|---|" + "---|" * (len(shapes) + bool(idle))]
    for system in systems:
        cells = [comparison[shape].get(system, []) for shape in shapes]
        row = [_parts_text({part: statistics.mean(c.part_cpu_us_per_token(part) for c in by_round)
                            for part in by_round[0].front_cpu_by_part}, "{:.0f}") if by_round else ""
               for by_round in cells]
        if idle:
            rounds = idle.get(system, [])
            row.append(_parts_text({part: statistics.mean(r[part] for r in rounds) for part in rounds[0]}, "{:.2f}")
                       if rounds else "")
        lines.append(f"| {system} | " + " | ".join(row) + " |")
    return lines


def _breakdown_text(comparison: Comparison, idle: Idle) -> list[str]:
    if not any(c.front_cpu_by_part for by_system in comparison.values() for cells in by_system.values()
               for c in cells):
        return []
    return [
        "*Where the front-end CPU goes*: the same figures split by process (per output token in each shape, and "
        "per second while idle). The worker holds the AsyncLLM work that `vllm serve`'s API server also does; "
        "the edge does the HTTP that the API server also does; redis-server is the bus, which `vllm serve` has "
        "no counterpart of, and its idle figure includes its own timer (`hz`: tokenbus runs Redis at 1 rather "
        "than the default 10, for the reasons `services.supervisor.REDIS_ARGS` gives).", "",
        *breakdown_table(comparison, idle), ""]


def _idle_text(idle: Idle) -> list[str]:
    if not idle:
        return []
    return [
        "*While idle*: at the start of every round all systems sit quiet for the same seconds, their front end's "
        "CPU measured as above (ms of CPU per second; the one-edge tokenbus counts one edge). An idle cost is paid "
        "whatever the load, so it adds (idle ms/s) / (output tok/s) to every cell's front-end CPU per token: most "
        "where the token rate is lowest.", "",
        *idle_table(idle), ""]


def _lengths(d: Distribution) -> str:
    return {"fixed": f"{d.a:.0f}", "uniform": f"{d.a:.0f}-{d.b:.0f}"}.get(d.kind, f"{d.a:.0f} +- {d.b:.0f}")


def _shapes_text(comparison: Comparison) -> list[str]:
    lines = []
    for name in dict.fromkeys(shape.name for shape in comparison):
        shapes = [shape for shape in comparison if shape.name == name]
        first = shapes[0]
        levels = ", ".join(f"{s.requests} requests at {s.concurrency} at once" for s in shapes)
        lines.append(f"- *{name}*: prompts of {_lengths(first.prompt_len)} words, {_lengths(first.output_len)} output "
                     f"tokens; {levels}, per round and system; on {', '.join(f'*{n}*' for n in first.systems)}.")
    return lines


def section(comparison: Comparison, images: list[str], engine: Engine, made_by: str = "", idle: Idle | None = None,
            machine: str = "", planned: int = 0) -> list[str]:
    """The whole section; `made_by` names the command when the section is written on its own; `idle` adds the
    systems' CPU while idle; `machine` describes the machine where it is not the document's; `planned`, the rounds
    the run asked for, where it holds fewer (written between rounds)."""
    rounds = len(next(iter(next(iter(comparison.values())).values())))
    unfinished = (f"**Unfinished**: {rounds} of the {planned} rounds asked for. The harness writes this section "
                  "after every round, and the run stopped after this one (or had not ended when it was read)."
                  if planned > rounds else "")
    gathering = f", stream interval {engine.stream_interval}: a stream gathers that many tokens per event" \
        if engine.stream_interval > 1 else ""
    where = f"on this machine: {machine}" if machine else "on the machine above"
    ran = {system for by_system in comparison.values() for system in by_system}
    scaled_out, two_servers = FOUR_EDGES in ran, VLLM_SERVE_2 in ran
    return [
        heading(engine), "",
        *([f"Made by `{made_by}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {where}.", ""] if made_by else []),
        *([unfinished, ""] if unfinished else []),
        f"Both systems run SmolLM2-135M-Instruct with the same engine settings ({engine.describe()}{gathering}"
        + (f", on one {engine.gpu} that {'both' if engine.engines == 2 else f'the {engine.engines}'} engines share"
           if engine.gpu else "") +
        ") and are up at the same time: tokenbus as one Redis (reached over a Unix socket, as `tokenbus run` "
        f"reaches its private one), one vLLM worker and {'four' if scaled_out else 'two'} edges, `vllm serve` as "
        "vLLM's OpenAI server" + (" (once with its one API server, once with `--api-server-count 2`)"
                                  if two_servers else "") + ". Each is warmed up first; then come "
        f"{rounds} rounds, in which every cell (a load shape on a system) runs once, the order reversed every other "
        "round, a second or two apart, with the same requests for every system (one seed per round and shape). "
        "*tokenbus* sends the load to its first edge; *tokenbus, 2 edges* deals it round-robin over two"
        + (" and *tokenbus, 4 edges* over four" if scaled_out else "") + ". The load "
        "is streamed chat requests with `ignore_eos`, greedy:", "",
        *_shapes_text(comparison), "",
        "Figures are means over the rounds. TTFT is the time to the first content token; ITL the time between "
        "content chunks; TPOT (latency - TTFT) / (tokens - 1), which does not depend on how tokens are grouped into "
        "chunks; goodput counts requests with TTFT <= 2 s and TPOT <= 200 ms. *TTFT, front end's share* is the mean "
        "TTFT less the mean of the engine's own (vLLM's `vllm:time_to_first_token_seconds`, read from the "
        "process that holds AsyncLLM before and after the cell, from a request's arrival to its first token out; "
        "both stamp the arrival before they render and tokenize the prompt: `vllm serve` as its API server starts "
        "on the request, tokenbus's worker as it takes up the job): the HTTP, for tokenbus the bus to the worker, "
        "and the first token's way back. The rest of a TTFT is the engine's queue and prefill, the same "
        "work in both systems, which a front end changes only by the CPU it takes from the engine (with more "
        "streams than the engine's sequences, tokenbus's share holds the wait for a slot in the request stream, "
        "which `vllm serve` spends in the engine's queue). *Front-end "
        "CPU* is the CPU time (each process's own, children not included: the scheduler's per-thread nanoseconds from "
        "/proc/<pid>/task/*/schedstat, or the process's 10 ms clock ticks from /proc/<pid>/stat where a thread ended "
        "during the cell) of everything the system "
        "runs beside vLLM's engine core, per output token streamed in the cell: for tokenbus its edge "
        "(each it uses, for two or four), the worker process (which also holds vLLM's AsyncLLM: tokenizing, "
        "detokenizing, output processing) and redis-server; "
        "for `vllm serve` its API-server process (the same AsyncLLM work, and the HTTP)"
        + ("; with two API servers, both of them and the process that launched them" if two_servers else "")
        + ". *Engine CPU* is every "
        "process below the worker or the API server, found from /proc's parent ids: vLLM's engine core, its model "
        "executor and a multiprocessing resource tracker. The load generator runs on the same cores.", "",
        *means_table(comparison), "",
        "Ratios are tokenbus / `vllm serve`" + (" (and, where it ran, / `vllm serve` with two API servers)"
                                                if two_servers else "")
        + f": the ratio of the means over the {rounds} rounds, and in brackets a 95% "
        f"percentile-bootstrap interval ({RESAMPLES} resamples of the round indices, the same indices for both "
        "systems, since a round's cells ran side by side). The verdict is **lead** or **loss** only where the "
        "interval leaves out 1.0 (more throughput is better; less latency and CPU are better), otherwise level "
        f"(within noise). From fewer than {MIN_ROUNDS} rounds no verdict is given; with few rounds a bootstrap "
        "interval is, if anything, too narrow.", "",
        *ratio_table(comparison), "",
        *_idle_text(idle or {}),
        *_breakdown_text(comparison, idle or {}),
        *[f"![{name}]({name})" for name in images],
        "",
    ]


def plots(comparison: Comparison, out_dir: Path, engine: Engine) -> list[str]:
    """Throughput and TTFT p50 against concurrency for the long shape, one line per system (none without it); a GPU
    run's files are named apart from a CPU run's."""
    longs = [shape for shape in comparison if shape.name == "long"]
    if not longs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    prefix = "bench-" if engine.gpu is None else "bench-gpu-"
    for of, label, file in ((lambda c: c.result.output_throughput, "output tokens/s", prefix + "throughput.png"),
                            (lambda c: c.result.ttft_ms.p50, "time to first token p50 (ms)", prefix + "ttft.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in dict.fromkeys(s for shape in longs for s in shape.systems):
            ax.plot([shape.concurrency for shape in longs], [_mean(comparison[shape][system], of) for shape in longs],
                    marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams (long requests)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} against concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / file, dpi=100)
        plt.close(fig)
        names.append(file)
    return names
