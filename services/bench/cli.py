"""`tokenbus bench`: `load` against any server, `edge` (simulated engine), `compare` (against `vllm serve`), `all`
(everything, then the report)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from services.bench import (
    batch_lane,
    batch_lane_report,
    cache,
    cache_report,
    compare,
    compare_report,
    edge_bench,
    fairness,
    fairness_report,
    floor,
    load,
    report,
    scale,
    scale_report,
    systems,
    wakes,
)
from services.bench.workload import Distribution, requests
from shared.runtime.settings import DEFAULT_MODEL_NAME


def add_arguments(bench: argparse.ArgumentParser) -> None:
    commands = bench.add_subparsers(dest="bench_command", required=True)
    one = commands.add_parser("load", help="run a load against an OpenAI-compatible server and print its figures")
    one.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    one.add_argument("--model", default=DEFAULT_MODEL_NAME)
    one.add_argument("--api", choices=sorted(load.PATHS), default="chat")
    one.add_argument("--concurrency", type=int, default=8, help="most requests in flight at once")
    one.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrivals per second (default: inf)")
    one.add_argument("--num-requests", type=int, default=64)
    one.add_argument("--prompt-len", type=Distribution.parse, default=Distribution("uniform", 64, 192),
                     help="words per prompt: fixed:N, uniform:LOW-HIGH or normal:MEAN,STD")
    one.add_argument("--output-len", type=Distribution.parse, default=Distribution("uniform", 64, 192),
                     help="output tokens per request (sent as max_tokens with ignore_eos)")
    one.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    one.add_argument("--slo-tpot-ms", type=float, default=200.0)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--json", action="store_true", help="print the result as JSON")
    for name, text in (("edge", "measure the edge and bus alone over the simulated engine"),
                       ("fairness", "FIFO against fair share between tenants on the simulated engine; writes its "
                                    "section of the report"),
                       ("scale", "1, 2 and 4 edges times 1, 2 and 4 workers on one Redis, simulated engine; writes "
                                 "its section of the report"),
                       ("batch", "an interactive tenant's time to first token alone and while a 10,000-line batch "
                                 "runs, simulated engine; writes its section of the report"),
                       ("cache", "dispatch and the prefix cache at 2, 4 and 8 simulated workers (shared prefixes, "
                                 "multi-turn, none shared); writes its section of the report"),
                       ("compare", "tokenbus against vllm serve in interleaved warm rounds; writes its section of "
                                   "the report"),
                       ("all", "compare with vllm serve, measure the edge, run vllm bench serve, measure fairness, "
                               "write the report")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
        sub.add_argument("--quick", action="store_true", help="a short run, for smoke tests")
        sub.add_argument("--model-dir", type=Path, default=None, help="default: the prepared SmolLM2 folder")
        if name in ("compare", "all"):
            sub.add_argument("--rounds", type=int, default=None,
                             help="interleaved rounds of the comparison with vllm serve (default: 6, 2 with --quick)")
        if name == "cache":
            sub.add_argument("--rounds", type=int, default=None,
                             help="runs of each dispatch per cell, side by side (default: 3, 1 with --quick)")
        if name in ("compare", "all"):
            sub.add_argument("--scale-out", action=argparse.BooleanOptionalAction, default=None,
                             help="add the c=256 short shape, tokenbus with 1, 2 and 4 edges against vllm serve "
                                  "with 1 and 2 API servers (default: on a GPU only)")
        if name == "compare":
            sub.add_argument("--stream-interval", type=int, default=1,
                             help="tokens a stream gathers per event, on both systems (vLLM's --stream-interval)")


def _print(result: load.Result) -> None:
    print(f"{result.system}: {result.requests} requests ({result.failed} failed) in {result.duration_s:.1f} s")
    print(f"  throughput  {result.output_throughput:.1f} output tok/s, {result.request_throughput:.2f} req/s, "
          f"goodput {result.goodput:.2f} req/s")
    for name, summary in (("TTFT", result.ttft_ms), ("first chunk", result.ttfc_ms), ("ITL", result.itl_ms),
                          ("TPOT", result.tpot_ms), ("E2E", result.e2e_ms)):
        print(f"  {name:<11} mean {summary.mean:8.1f}  p50 {summary.p50:8.1f}  p90 {summary.p90:8.1f}  "
              f"p99 {summary.p99:8.1f} ms")
    if result.first_error:
        print(f"  first error: {result.first_error}")


def _engine(model_dir: Path | None) -> systems.Engine:
    from services.worker.models import resolve_model_dir

    return systems.Engine.on_this_machine(DEFAULT_MODEL_NAME, model_dir or resolve_model_dir(""))


def _edge_parts(engine: systems.Engine, log_dir: Path, quick: bool) -> dict[str, object]:
    scale = 4 if quick else 1
    hops = []
    for pin in (True, False) if edge_bench.can_pin() else (False,):
        print(f"edge alone: hop overhead, load generator {'on its own core' if pin else 'sharing'}", file=sys.stderr)
        hops.append(edge_bench.hop_overhead(engine, log_dir / "sim.log", streams=64 // scale, pin=pin))
    print("edge alone: throughput and CPU per token", file=sys.stderr)
    throughput = edge_bench.edge_throughput(engine, log_dir / "sim.log", streams=256 // scale, tokens=256 // scale)
    print("edge alone: many concurrent streams", file=sys.stderr)
    many = edge_bench.many_streams(engine, log_dir / "sim.log", streams=2000 // (10 * scale if quick else 1))
    print("what a wake costs this machine", file=sys.stderr)
    woken = wakes.measure(wakes=50 if quick else 300)
    print("the least two hops through Redis cost this machine", file=sys.stderr)
    hop_floor = floor.measure(round_trips=50 if quick else 300)
    return {"hops": tuple(hops), "throughput": throughput, "many": many, "wakes": woken, "floor": hop_floor}


def run(args: argparse.Namespace) -> int:
    # SIGTERM (from `timeout`, CI or Ctrl-C's cousin) unwinds like an exception, so every system the
    # harness started is stopped by its context manager instead of being orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.bench_command == "load":
        shape = load.Load(args.base_url, args.model, args.api, args.concurrency, args.rate, args.slo_ttft_ms,
                          args.slo_tpot_ms)
        result = asyncio.run(load.run(shape, requests(args.num_requests, args.prompt_len, args.output_len,
                                                      args.seed), seed=args.seed))
        print(json.dumps(result.as_dict(), indent=2)) if args.json else _print(result)
        return 0 if result.failed == 0 else 1
    if args.bench_command == "fairness":
        return _fairness(args)
    if args.bench_command == "scale":
        return _scale(args)
    if args.bench_command == "batch":
        return _batch(args)
    if args.bench_command == "cache":
        return _cache(args)
    if args.bench_command == "compare":
        return _compare(args)
    engine = _engine(args.model_dir) if args.bench_command == "all" else systems.Engine(
        model=DEFAULT_MODEL_NAME, model_dir=Path("."))
    log_dir = Path(tempfile.mkdtemp(prefix="tokenbus-bench-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    comparison: compare.Comparison = {}
    idle: compare.Idle = {}
    vllm_bench = None
    if args.bench_command == "all":
        comparison, idle, engine = _comparison(args, engine, log_dir)
        vllm_bench = compare.vllm_bench_serve(engine, log_dir, prompts=8 if args.quick else 16)
        print(vllm_bench[1])
    parts = _edge_parts(engine, log_dir, args.quick)
    for part in parts.values():
        print(part)
    document = report.Report(command="tokenbus bench " + " ".join(sys.argv[2:]), comparison=comparison,
                             vllm_bench=vllm_bench, idle=idle, engine=engine, **parts)  # type: ignore[arg-type]
    report.write(document, args.out)
    print(f"wrote {args.out}")
    if args.bench_command != "all":
        return 0
    return max(_fairness(args), _scale(args), _batch(args), _cache(args))


def _comparison(args: argparse.Namespace, engine: systems.Engine, log_dir: Path, command: str = "",
                ) -> tuple[compare.Comparison, compare.Idle, systems.Engine]:
    """The comparison the arguments ask for, and the engine settings it ran with (its engines share the GPU). With
    a `command`, its section in `args.out` is written after every round too, saying how many it holds, so that a
    run cut short (a lent GPU machine taken back) leaves the rounds it made."""
    scale_out = engine.gpu is not None if args.scale_out is None else args.scale_out
    plan = compare.Plan.quick(scale_out=scale_out) if args.quick else compare.Plan.full(scale_out=scale_out)
    if args.rounds is not None:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    engine = dataclasses.replace(engine, engines=plan.engines)

    def so_far(comparison: compare.Comparison, idle: compare.Idle, done: int, planned: int) -> None:
        if done < planned:
            report.write_comparison(comparison, args.out, command, engine, idle, planned)

    comparison, idle = compare.compare(engine, plan, log_dir, so_far if command else None)
    for system, rounds in idle.items():
        print(f"idle {system}: {statistics.mean(compare.idle_totals(rounds)):.2f} ms of front-end CPU per s")
    for row in compare_report.ratios(comparison):
        print(f"{row.shape.name} c={row.shape.concurrency} {row.system} / {row.baseline}: " + ", ".join(
            f"{r.metric.label} {r.interval.estimate:.3f}x [{r.interval.low:.3f}, {r.interval.high:.3f}] {r.verdict}"
            for r in row.ratios))
    return comparison, idle, engine


def _compare(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="tokenbus-bench-"))
    print(f"compare: logs in {log_dir}", file=sys.stderr)
    engine = dataclasses.replace(_engine(args.model_dir), stream_interval=args.stream_interval)
    command = "tokenbus bench " + " ".join(sys.argv[2:])
    comparison, idle, engine = _comparison(args, engine, log_dir, command)
    report.write_comparison(comparison, args.out, command, engine, idle)
    print(f"wrote the comparison section of {args.out}")
    failed = sum(cell.result.failed for by_system in comparison.values() for cells in by_system.values()
                 for cell in cells)
    return 0 if failed == 0 else 1


def _scale(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="tokenbus-bench-"))
    print(f"scale: logs in {log_dir}", file=sys.stderr)
    plan = scale.Plan.quick() if args.quick else scale.Plan()
    result = scale.measure(log_dir / "scale.log", plan, DEFAULT_MODEL_NAME)
    scale_report.write(result, args.out, "tokenbus bench " + " ".join(sys.argv[2:]))
    print(f"wrote the scale section of {args.out}")
    return 0 if all(cell.failed == 0 for cell in result.cells) else 1


def _fairness(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="tokenbus-bench-"))
    print(f"fairness: logs in {log_dir}", file=sys.stderr)
    result = fairness.measure(log_dir / "fairness.log", fairness.Plan.quick() if args.quick else fairness.Plan())
    for measured in result.scenarios:
        print(f"{measured.scenario}, {measured.scheduler} ({measured.window_s:.1f} s):")
        for figures in measured.tenants.values():
            print(f"  {figures.tenant:<16} TTFT p50 {figures.ttft_ms.p50:7.0f} ms  p99 {figures.ttft_ms.p99:7.0f} ms  "
                  f"{figures.requests:4d} requests ({figures.failed} failed)  {figures.tokens:6d} tokens "
                  f"({figures.share:.1%})")
    fairness_report.write(result, args.out, "tokenbus bench " + " ".join(sys.argv[2:]))
    print(f"wrote the fairness section of {args.out}")
    return 0 if all(f.failed == 0 for measured in result.scenarios for f in measured.tenants.values()) else 1


def _batch(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="tokenbus-bench-"))
    print(f"batch lane: logs in {log_dir}", file=sys.stderr)
    result = batch_lane.measure(log_dir / "batch.log", batch_lane.Plan.quick() if args.quick else batch_lane.Plan())
    print(f"interactive TTFT p50 alone {result.alone_ms.p50:.0f} ms, while the batch runs {result.during_ms.p50:.0f} "
          f"ms ({result.ratio:.2f}x); batch {result.lines_per_s:.0f} lines/s; {result.failed} failed")
    batch_lane_report.write(result, args.out, "tokenbus bench " + " ".join(sys.argv[2:]))
    print(f"wrote the batch lane section of {args.out}")
    return 0 if result.failed == 0 else 1


def _cache(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="tokenbus-bench-"))
    print(f"prefix cache: logs in {log_dir}", file=sys.stderr)
    plan = cache.Plan.quick() if args.quick else cache.Plan()
    if args.bench_command == "cache" and args.rounds:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    result = cache.measure(log_dir / "cache.log", plan)
    real = [] if args.quick else cache.measure_real(log_dir / "cache-vllm.log", _engine(args.model_dir),
                                                    cache.RealPlan())
    cache_report.write(result, real, args.out, "tokenbus bench " + " ".join(sys.argv[2:]))
    print(f"wrote the prefix cache section of {args.out}")
    return 0 if all(cell.failed == 0 for cell in [*result.cells, *real]) else 1
