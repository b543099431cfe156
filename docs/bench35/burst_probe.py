"""Where a burst's first tokens spend their time, two trees side by side: the long c=32 cell only (32 requests at
once), in interleaved rounds, with the engine's own view from each worker's `vllm:` histograms (time to first token
from the engine's arrival, queue time, prefill time) beside the client's time to first token. The client's minus
the engine's is the front end's share: edge, Redis and the worker before `add_request` and after the first token.

    .venv/bin/python docs/bench35/burst_probe.py OLD_DIR NEW_DIR ROUNDS out.json
"""
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from services.bench import compare, load, systems
from services.bench.cli import _engine
from services.bench.workload import requests

HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:e2e_request_latency_seconds")


def engine_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram of HISTOGRAMS, from a worker's /metrics."""
    text = httpx.get(url, timeout=10).text
    return {name: (systems.sample(text, name + "_sum"), systems.sample(text, name + "_count")) for name in HISTOGRAMS}


def main() -> None:
    old_tree, new_tree, rounds, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    shape = compare.long_shape(32, 32)
    log_dir = Path(tempfile.mkdtemp(prefix="burst-probe-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    engine = dataclasses.replace(_engine(None), engines=2)
    out: dict[str, list[dict[str, object]]] = {"old": [], "new": []}
    with ExitStack() as stack:
        runs = {}
        here = os.getcwd()
        for name, tree in (("old", old_tree), ("new", new_tree)):
            os.chdir(tree)
            running = stack.enter_context(systems.tokenbus(engine, log_dir / f"{name}.log", edges=1))
            runs[name] = (compare.tokenbus_deployments(running)[compare.TOKENBUS], running.worker_metrics_urls[0])
        os.chdir(here)
        for deployment, _ in runs.values():
            compare.warm_up(deployment, engine.model, "chat")
        for round_no in range(rounds):
            names = ["old", "new"] if round_no % 2 == 0 else ["new", "old"]
            for name in names:
                deployment, metrics_url = runs[name]
                time.sleep(1.5)
                work = requests(shape.requests, shape.prompt_len, shape.output_len, seed=1000 * round_no + 2)
                spec = compare._load(deployment, engine.model, "chat", shape.concurrency)
                before = engine_sums(metrics_url)
                timings, _ = asyncio.run(load.collect(spec, work, system=name, quiet=True))
                after = engine_sums(metrics_url)
                t0 = min(t.start for t in timings)
                ttfts = sorted((t.content[0] - t.start) * 1000 for t in timings if t.ok)
                starts = sorted((t.start - t0) * 1000 for t in timings)
                engine_ms = {key.split(":")[1]: 1000 * (after[key][0] - before[key][0])
                             / max(1.0, after[key][1] - before[key][1]) for key in after}
                cell = {"ttft_ms": ttfts, "client_starts_ms": starts, "engine_mean_ms": engine_ms,
                        "client_ttft_mean_ms": statistics.fmean(ttfts)}
                out[name].append(cell)
                print(f"round {round_no + 1} {name}: client TTFT p50 {statistics.median(ttfts):.0f} mean "
                      f"{cell['client_ttft_mean_ms']:.0f}; engine " + ", ".join(
                          f"{k} {v:.0f}" for k, v in engine_ms.items()), file=sys.stderr)
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
