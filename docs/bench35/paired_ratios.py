"""Reads what trees_side_by_side.py wrote: new / old per shape and metric, as the ratio of the means over the rounds
with a 95% percentile bootstrap over the round indices (the same indices for both: they ran side by side)."""
import json
import random
import statistics
import sys

data = json.load(open(sys.argv[1]))
OLD, NEW = "tokenbus old", "tokenbus new"
SERVE = "vllm serve" if "vllm serve" in next(iter(data.values())) else NEW
rng = random.Random(0)
def ratio(a, b, idx): return statistics.mean(a[i] for i in idx) / statistics.mean(b[i] for i in idx)
def interval(a, b):
    n = len(a); boots = sorted(ratio(a, b, [rng.randrange(n) for _ in range(n)]) for _ in range(4000))
    return ratio(a, b, range(n)), boots[100], boots[3899]
print("| shape | metric | old | new | vllm serve | new / old [95%] |")
print("|---|---|---|---|---|---|")
for shape, systems in data.items():
    if shape == "idle":
        continue
    for key, name, higher_better in (("tok_s", "output tok/s", True), ("ttft_p50", "TTFT p50 ms", False),
                                      ("tpot_p50", "TPOT p50 ms", False), ("front_us", "front-end CPU us/token", False),
                                      ("front_ttft", "TTFT, front end's share ms", False)):
        if key not in systems[OLD][0]:
            continue  # written before the script recorded it
        o, n, s = ([c[key] for c in systems[x]] for x in (OLD, NEW, SERVE))
        r, lo, hi = interval(n, o)
        verdict = "level" if lo <= 1 <= hi else ("better" if (lo > 1) == higher_better else "**worse**")
        print(f"| {shape} | {name} | {statistics.mean(o):.1f} | {statistics.mean(n):.1f} | {statistics.mean(s):.1f} "
              f"| {r:.3f}x [{lo:.3f}, {hi:.3f}] {verdict} |")
for shape, systems in data.items():
    if shape == "idle":
        continue
    parts = {x: {p: statistics.mean(c["parts"][p] for c in systems[x]) for p in systems[x][0]["parts"]} for x in (OLD, NEW)}
    print(shape, {x: {p: round(v) for p, v in ps.items()} for x, ps in parts.items()})
idle = data["idle"]
for x in (OLD, NEW, SERVE):
    print("idle", x, round(statistics.mean(sum(r.values()) for r in idle[x]), 2), "ms/s")
