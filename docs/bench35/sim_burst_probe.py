"""How long a burst takes to reach the engine in several trees of tokenbus, each over the simulated engine (fixed
50 ms to a first token): bursts of 32 chat requests with long prompts sent in the same instant, the trees taking
turns round by round. The simulator's time to first token is the same in every tree, so the client's mean time
to first token, less it, is the front end's share, without an engine's noise.

    .venv/bin/python docs/bench35/sim_burst_probe.py ROUNDS out.json TREE [TREE...]
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

from services.bench import compare, load, systems
from services.bench.cli import _engine
from services.bench.workload import Distribution, requests

SIM_TTFT_MS, SIM_ITL_MS, STREAMS = 50.0, 20.0, 32


def main() -> None:
    rounds, out_path, trees = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    log_dir = Path(tempfile.mkdtemp(prefix="sim-burst-"))
    engine = dataclasses.replace(_engine(None), engines=len(trees))
    out: dict[str, list[float]] = {tree: [] for tree in trees}
    with ExitStack() as stack:
        deployments = {}
        here = os.getcwd()
        for i, tree in enumerate(trees):
            os.chdir(tree)
            running = stack.enter_context(systems.tokenbus(engine, log_dir / f"{i}.log", sim=(SIM_TTFT_MS, SIM_ITL_MS)))
            deployments[tree] = compare.tokenbus_deployments(running)[compare.TOKENBUS]
        os.chdir(here)
        for deployment in deployments.values():
            compare.warm_up(deployment, engine.model, "chat")
        for round_no in range(rounds):
            order = trees if round_no % 2 == 0 else trees[::-1]
            for tree in order:
                time.sleep(0.5)
                work = requests(STREAMS, Distribution("uniform", 64, 192), Distribution("fixed", 8), seed=round_no)
                spec = compare._load(deployments[tree], engine.model, "chat", STREAMS)
                timings, _ = asyncio.run(load.collect(spec, work, system=tree, quiet=True))
                ttfts = [(t.content[0] - t.start) * 1000 - SIM_TTFT_MS for t in timings if t.ok]
                out[tree].append(statistics.fmean(ttfts))
            print(f"round {round_no + 1}: " + ", ".join(f"{t}: {out[t][-1]:.1f} ms" for t in trees), file=sys.stderr)
    for tree in trees:
        print(f"{tree}: mean {statistics.fmean(out[tree]):.2f} ms, median {statistics.median(out[tree]):.2f} ms")
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
