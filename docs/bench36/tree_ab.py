"""Two trees of tokenbus side by side: front-end CPU per streamed token of a base tree (a git worktree) against this
working tree, each system with its own Redis, worker and one edge, up at once; the long shape of `bench compare`
(chat requests of 64-192-word prompts and 64-192 output tokens, all sent at once), rounds alternating the order,
the same requests for both in a round. With --sim the workers run the simulated engine (50 ms to the first token,
20 ms a step) instead of vLLM, so that what the bus and the worker cost per token is not lost in the engine's noise.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python docs/bench36/tree_ab.py /tmp/base ROUNDS STREAMS [--sim]

Prints each round, the means by process and the ratios (this tree / base, paired bootstrap over the rounds) of the
front end's total and of the worker's share.
"""
import dataclasses
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from services.bench import compare, systems
from services.bench.cli import _engine
from services.bench.stats import paired_bootstrap_ratio
from services.bench.workload import requests
from shared.runtime import processes

sys.path.insert(0, str(Path(__file__).parent))
import cpu_floor  # noqa: E402 - beside this script

_SPAWN = processes.spawn
_CWD: dict[str, str | None] = {"dir": None}


def _spawn_in_tree(role, env, log=None, own_session=True, cwd=None):
    """`tokenbus <role>` from the tree being started (python -m puts its working directory first on the path)."""
    return _SPAWN(role, env, log, own_session, cwd or _CWD["dir"])


def main() -> None:
    base, rounds, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sim = (50.0, 20.0) if "--sim" in sys.argv else None
    shape = compare.long_shape(streams, streams)
    engine = dataclasses.replace(_engine(None), engines=2)
    log_dir = Path(tempfile.mkdtemp(prefix="tree-ab-"))
    processes.spawn = systems.processes.spawn = _spawn_in_tree
    results: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack:
        ups = {}
        for name, cwd in (("base", base), ("this tree", None)):
            _CWD["dir"] = cwd
            running = stack.enter_context(systems.tokenbus(engine, log_dir / f"{name}.log", edges=1, sim=sim))
            ups[name] = compare.tokenbus_deployments(running)[compare.TOKENBUS]
        _CWD["dir"] = None
        if sim is None:
            for deployment in ups.values():
                compare.warm_up(deployment, engine.model, "chat")
        for round_no in range(rounds):
            work = requests(shape.requests, shape.prompt_len, shape.output_len, seed=7000 + round_no)
            for name in list(ups) if round_no % 2 == 0 else list(reversed(ups)):
                time.sleep(1.0)
                cell = cpu_floor._cell(ups[name], engine.model, work, True)
                results.setdefault(name, []).append(cell)
                print(f"round {round_no + 1}: {name}: " + " + ".join(f"{p} {v:.0f}" for p, v in cell.items())
                      + f" = {sum(cell.values()):.0f} us/token", flush=True)
    for name, cells in results.items():
        print(f"{name}: " + " + ".join(f"{p} {statistics.mean(c[p] for c in cells):.0f}" for p in cells[0])
              + f" = {statistics.mean(sum(c.values()) for c in cells):.0f} us/token")
    for label, pick in (("front end", lambda cell: sum(cell.values())), ("worker", lambda cell: cell["worker"])):
        ours, theirs = ([pick(c) for c in results[k]] for k in ("this tree", "base"))
        ratio = paired_bootstrap_ratio(ours, theirs)
        print(f"{label}, this tree / base: {ratio.estimate:.3f}x [{ratio.low:.3f}, {ratio.high:.3f}]")


if __name__ == "__main__":
    main()
