"""The fairness section of docs/benchmarks.md and its plot, from what `tokenbus bench fairness` measured."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from services.bench import fairness
from services.bench.report import splice
from shared.runtime.settings import Settings, headroom_seqs

FAIRNESS_HEADING = "## Fair share between tenants (simulated engine)"
FAIRNESS_PLOT = "bench-fairness.png"


def _headroom() -> int:
    return headroom_seqs(Settings(max_num_seqs=fairness.SLOTS))


def fairness_section(result: fairness.Result, command: str, image: str | None) -> list[str]:
    plan = result.plan
    lines = [
        FAIRNESS_HEADING, "",
        f"Made by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, on the machine above. One edge with API "
        f"keys, one simulated worker with {fairness.SLOTS} slots (TTFT {plan.sim_ttft_ms:.0f} ms, ITL "
        f"{plan.sim_itl_ms:.0f} ms, prefills in one lane at {plan.sim_prefill_us_per_token:g} us a prompt word, "
        f"the most urgent first), streamed chat requests of 16 prompt words; B asks for {plan.tokens} tokens a "
        f"request. A's flood takes three shapes: {fairness.SAME} ({plan.tokens} tokens each: they start and end "
        f"together, and the slots free in waves), {fairness.MIXED} ({plan.tokens // 2} to {plan.tokens * 3 // 2} "
        f"tokens) and {fairness.LONG} ({plan.long_prompt_words} words, mixed lengths: prefill-heavy). Each "
        "scheduler runs on fresh processes; each loading tenant is a client process of its own. Figures are taken "
        f"over the measured window, after {plan.warmup_s:.0f} s of load. With fair share the worker runs "
        f"{_headroom()} sequences beyond its slots (`--fair-headroom`) for a tenant running no more than that many, "
        "and gives the engine each job's priority from its tenant's standing.", "",
        f"**Tenant A keeps {plan.flood_streams} streams in flight while tenant B sends one request at a time** "
        f"(B alone: {plan.alone_requests} requests before A starts).", "",
        "| scheduler | A's flood | B alone TTFT p50 / p99 | B during the flood TTFT p50 / p99 | B p50 / alone "
        "| A TTFT p50 / p99 | B's requests | window | tokens/s served | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scheduler, shape in ((s, f) for s in plan.schedulers for f in fairness.FLOODS):
        run = result.scenario(f"flood: {shape}", scheduler)
        alone, b, a = (run.tenants[name] for name in (f"{fairness.SIPPER} alone", fairness.SIPPER, fairness.FLOODER))
        lines.append(
            f"| {scheduler} | {shape} | {alone.ttft_ms.p50:.0f} / {alone.ttft_ms.p99:.0f} ms | {b.ttft_ms.p50:.0f} / "
            f"{b.ttft_ms.p99:.0f} ms | {b.ttft_ms.p50 / alone.ttft_ms.p50:.1f}x | {a.ttft_ms.p50:.0f} / "
            f"{a.ttft_ms.p99:.0f} ms | {b.requests} | {run.window_s:.1f} s | "
            f"{(a.tokens + b.tokens) / run.window_s:.0f} | {a.failed + b.failed + alone.failed} |")
    lines += ["", f"**Two tenants with weights 1 and 2 keep {plan.weighted_streams} streams in flight each.**", "",
              "| scheduler | weight 1 tokens | weight 2 tokens | weight 2 / weight 1 | weight 2's share | "
              "tokens/s served | failed |", "|---|---|---|---|---|---|---|"]
    for scheduler in plan.schedulers:
        run = result.scenario("weights", scheduler)
        light, heavy = run.tenants[fairness.LIGHT], run.tenants[fairness.HEAVY]
        lines.append(f"| {scheduler} | {light.tokens} | {heavy.tokens} | {heavy.tokens / max(light.tokens, 1):.2f} "
                     f"| {heavy.share:.1%} | {(light.tokens + heavy.tokens) / run.window_s:.0f} "
                     f"| {light.failed + heavy.failed} |")
    return [*lines, "", *([f"![{image}]({image})", ""] if image else [])]


def fairness_plot(result: fairness.Result, out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedulers = result.plan.schedulers
    fig, (ttft, shares) = plt.subplots(1, 2, figsize=(12, 4))
    places = range(len(schedulers))
    width = 0.8 / (1 + len(fairness.FLOODS))
    bars = [("B alone", f"{fairness.FLOODS[0]}", f"{fairness.SIPPER} alone")] + [
        (f"B, A's flood: {shape}", shape, fairness.SIPPER) for shape in fairness.FLOODS]
    for offset, (label, shape, name) in enumerate(bars):
        ttft.bar([p + offset * width for p in places],
                 [result.scenario(f"flood: {shape}", s).tenants[name].ttft_ms.p50 for s in schedulers], width=width,
                 label=label)
    ttft.set_yscale("log")
    ttft.set_ylabel("B's time to first token p50 (ms)")
    ttft.set_title(f"A keeps {result.plan.flood_streams} streams in flight")
    for offset, (name, label) in enumerate(((fairness.LIGHT, "weight 1"), (fairness.HEAVY, "weight 2"))):
        shares.bar([p + offset * 0.4 for p in places],
                   [result.scenario("weights", s).tenants[name].share for s in schedulers], width=0.4, label=label)
    shares.axhline(2 / 3, color="gray", linestyle="--", linewidth=1)
    shares.axhline(1 / 3, color="gray", linestyle="--", linewidth=1)
    shares.set_ylabel("share of tokens served")
    shares.set_title("weights 1 : 2 (dashed: 1/3 and 2/3)")
    ttft.set_xticks([p + 0.4 - width / 2 for p in places], schedulers)
    shares.set_xticks([p + 0.2 for p in places], schedulers)
    for ax in (ttft, shares):
        ax.legend()
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / FAIRNESS_PLOT, dpi=100)
    plt.close(fig)
    return FAIRNESS_PLOT


def write(result: fairness.Result, path: Path, command: str) -> None:
    """Puts the section (and its plot, next to the document) in place of the one the document has, if any."""
    path.parent.mkdir(parents=True, exist_ok=True)
    splice(path, FAIRNESS_HEADING, fairness_section(result, command, fairness_plot(result, path.parent)))
