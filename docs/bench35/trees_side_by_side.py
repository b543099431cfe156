"""Two trees of tokenbus up at the same time (and `vllm serve` beside them), measured in the same interleaved rounds
with `tokenbus bench compare`'s harness, so that a round of one pairs with the same round of the other: what issue
35 asked for ("no loss beyond noise against the numbers before the change"), where runs one after the other moved
by more than the change (vllm serve's own figures, unchanged code, moved 5-8% between two runs an hour apart).

    git worktree add /work/bench-old dbbcbb5 && ln -s $PWD/.venv /work/bench-old/.venv
    .venv/bin/python docs/bench35/trees_side_by_side.py /work/bench-old $PWD 5 /tmp/paired.json [--no-serve]
    .venv/bin/python docs/bench35/paired_ratios.py /tmp/paired.json

Each tree's processes run the code of the folder they start in (`python -m services.cli` puts it first on the
path); the harness is this tree's."""
import dataclasses
import json
import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from services.bench import compare, systems
from services.bench.cli import _engine

old_tree, new_tree, rounds, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
serving = "--no-serve" not in sys.argv
OLD, NEW = "tokenbus old", "tokenbus new"
log_dir = Path(tempfile.mkdtemp(prefix="bench35-"))
print(f"logs in {log_dir}", file=sys.stderr)
full = compare.Plan.full(rounds=rounds)
shapes = tuple(dataclasses.replace(s, systems=(OLD, NEW, *([compare.VLLM_SERVE] if serving else []))) for s in full.shapes
               if s.name != "scale-out")
plan = dataclasses.replace(full, shapes=shapes)
engine = dataclasses.replace(_engine(None), engines=3 if serving else 2)
with ExitStack() as stack:
    deployments = {}
    here = os.getcwd()
    for name, tree in ((OLD, old_tree), (NEW, new_tree)):
        os.chdir(tree)  # the children run the code of the folder they start in (python -m services.cli)
        running = stack.enter_context(systems.tokenbus(engine, log_dir / f"{name.split()[1]}.log", edges=1))
        deployments[name] = compare.tokenbus_deployments(running)[compare.TOKENBUS]
    os.chdir(here)
    if serving:
        serve = stack.enter_context(systems.vllm_serve(engine, log_dir / "vllm-serve.log"))
        deployments[compare.VLLM_SERVE] = compare.vllm_serve_deployment(serve)
    for name, deployment in deployments.items():
        print(f"{name}: {deployment.describe()}", file=sys.stderr)
        compare.warm_up(deployment, engine.model, plan.api)
    comparison, idle = compare._rounds(deployments, engine.model, plan)
out = {f"{shape.name} c={shape.concurrency}": {
    system: [{"tok_s": c.result.output_throughput, "ttft_p50": c.result.ttft_ms.p50, "tpot_p50": c.result.tpot_ms.p50,
              "front_us": c.front_cpu_us_per_token,
              "ttft_mean": c.result.ttft_ms.mean, "front_ttft": c.front_ttft_ms,
              "parts": {p: c.part_cpu_us_per_token(p) for p in c.front_cpu_by_part}} for c in cells]
    for system, cells in by_system.items()} for shape, by_system in comparison.items()}
out["idle"] = idle
out_path.write_text(json.dumps(out, indent=1))
print(f"wrote {out_path}", file=sys.stderr)
