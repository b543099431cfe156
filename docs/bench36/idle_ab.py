"""Two trees of tokenbus side by side while idle: each process's CPU and wakes per second (context switches, every
thread's, from /proc) of a base tree (a git worktree) against this working tree, each system with its own Redis,
simulated worker and one edge, up at once, measured over the same seconds in every round after a warm-up request.
An idle cost is paid whatever the load: at a few tokens a second (vLLM on a CPU, long c=8: 20-30 tokens a second)
each ms/s of it is 30-50 us of front-end CPU per token.

    git worktree add /tmp/base HEAD~1
    .venv/bin/python docs/bench36/idle_ab.py /tmp/base ROUNDS SECONDS

Prints each round, the means by process and the ratio (this tree / base, paired bootstrap over the rounds) of the
front end's total CPU while idle.
"""
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from services.bench import compare, systems
from services.bench.cli import _engine
from services.bench.stats import paired_bootstrap_ratio
from shared.runtime import processes

sys.path.insert(0, str(Path(__file__).parent))
import tree_ab  # beside this script


def _reading(pid: int) -> tuple[int, int]:
    """The process's CPU nanoseconds and context switches so far, every thread's."""
    cpu = switches = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                cpu += int(schedstat.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                switches += sum(int(line.split()[1]) for line in status if "ctxt_switches:" in line)
        except OSError:  # a thread that ended meanwhile
            continue
    return cpu, switches


def main() -> None:
    base, rounds, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    engine = dataclasses.replace(_engine(None), engines=2)
    log_dir = Path(tempfile.mkdtemp(prefix="idle-ab-"))
    processes.spawn = systems.processes.spawn = tree_ab._spawn_in_tree
    results: dict[str, list[dict[str, tuple[float, float]]]] = {}
    with ExitStack() as stack:
        ups = {}
        for name, cwd in (("base", base), ("this tree", None)):
            tree_ab._CWD["dir"] = cwd
            running = stack.enter_context(systems.tokenbus(engine, log_dir / f"{name}.log", edges=1, sim=(50.0, 20.0)))
            ups[name] = compare.tokenbus_deployments(running)[compare.TOKENBUS]
        tree_ab._CWD["dir"] = None
        for deployment in ups.values():
            compare.warm_up(deployment, engine.model, "chat")
        time.sleep(seconds)
        for round_no in range(rounds):
            before = {name: {part: _reading(pid) for part, pid in up.front} for name, up in ups.items()}
            time.sleep(seconds)
            for name, up in ups.items():
                cell = {}
                for part, pid in up.front:
                    cpu, switches = _reading(pid)
                    cell[part] = ((cpu - before[name][part][0]) / 1e6 / seconds,
                                  (switches - before[name][part][1]) / seconds)
                results.setdefault(name, []).append(cell)
                print(f"round {round_no + 1}: {name}: " + " + ".join(
                    f"{p} {ms:.2f} ms/s ({wakes:.1f}/s)" for p, (ms, wakes) in cell.items()), flush=True)
    for name, cells in results.items():
        parts = {p: (statistics.mean(c[p][0] for c in cells), statistics.mean(c[p][1] for c in cells))
                 for p in cells[0]}
        print(f"{name}: " + " + ".join(f"{p} {ms:.2f} ms/s ({wakes:.1f} switches/s)" for p, (ms, wakes) in
                                      parts.items())
              + f" = {sum(ms for ms, _ in parts.values()):.2f} ms/s")
    ours, theirs = ([sum(ms for ms, _ in c.values()) for c in results[k]] for k in ("this tree", "base"))
    ratio = paired_bootstrap_ratio(ours, theirs)
    print(f"front end while idle, this tree / base: {ratio.estimate:.3f}x [{ratio.low:.3f}, {ratio.high:.3f}]")


if __name__ == "__main__":
    main()
