"""The per-cell figures of a `tokenbus bench compare` run, read back from its progress log (the lines
`round i/N <shape> c=<n> <system>: ...`), as means over rounds and paired ratios with 95% bootstrap intervals,
computed by the harness's own statistics (services.bench.stats). For a run whose machine went back before the
harness wrote its section: the 2026-11-28 H100 run (h100-a6b8fa3-bench.log), whose last cell never ran.

    python docs/bench36/gpu_from_log.py docs/bench36/h100-a6b8fa3-bench.log
"""

import re
import statistics
import sys
from collections import defaultdict

from services.bench.stats import paired_bootstrap_ratio, verdict

CELL = re.compile(r"round (\d+)/\d+ (\S+) c=(\d+) ([^:]+): ([\d.]+) tok/s, TTFT p50 (\d+) ms, TPOT p50 ([\d.]+) ms, "
                  r"front-end CPU (\d+) us/token, failed (\d+)(?:, front end's share of TTFT ([\d.na-]+) ms)?")
IDLE = re.compile(r"round (\d+)/\d+ idle ([^:]+): ([\d.]+) ms")
METRICS = (("throughput", 0, True), ("TTFT p50", 1, False), ("TPOT p50", 2, False), ("front-end CPU/token", 3, False))
BASELINES = ("vllm serve", "vllm serve, 2 API servers")


def main(path: str) -> None:
    cells: dict[tuple[str, int], dict[str, dict[int, tuple[float, ...]]]] = defaultdict(lambda: defaultdict(dict))
    idle: dict[str, dict[int, float]] = defaultdict(dict)
    failed = 0
    for line in open(path):
        if found := CELL.search(line):
            rnd, shape, conc, system, *figures = found.groups()
            cells[(shape, int(conc))][system][int(rnd)] = tuple(float(f) for f in figures[:4])
            failed += int(figures[4])
        elif found := IDLE.search(line):
            idle[found.group(2)][int(found.group(1))] = float(found.group(3))
    print(f"failed requests: {failed}\n")
    print("| shape | streams | system | rounds | output tok/s | TTFT p50 | TPOT p50 | front-end CPU per token |")
    print("|---|---|---|---|---|---|---|---|")
    for (shape, conc), systems in cells.items():
        for system, rounds in systems.items():
            m = [statistics.mean(r[i] for r in rounds.values()) for i in range(4)]
            print(f"| {shape} | {conc} | {system} | {len(rounds)} | {m[0]:.0f} | {m[1]:.0f} ms | {m[2]:.1f} ms | "
                  f"{m[3]:.0f} us |")
    print("\n| shape | streams | ratio | rounds | " + " | ".join(name for name, _, _ in METRICS) + " |")
    print("|---|---|---|---|" + "---|" * len(METRICS))
    for (shape, conc), systems in cells.items():
        for baseline in BASELINES:
            if baseline not in systems:
                continue
            for system, rounds in systems.items():
                if system in BASELINES:
                    continue
                both = sorted(set(rounds) & set(systems[baseline]))
                texts = []
                for _, i, higher in METRICS:
                    interval = paired_bootstrap_ratio([rounds[r][i] for r in both],
                                                      [systems[baseline][r][i] for r in both])
                    texts.append(f"{interval.estimate:.3f}x [{interval.low:.3f}, {interval.high:.3f}] "
                                 f"{verdict(interval, higher)}")
                print(f"| {shape} | {conc} | {system} / {baseline} | {len(both)} | " + " | ".join(texts) + " |")
    print("\n| system | idle front-end CPU, ms/s (mean of rounds) |\n|---|---|")
    for system, rounds in idle.items():
        print(f"| {system} | {statistics.mean(rounds.values()):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
