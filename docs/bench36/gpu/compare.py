"""`tokenbus bench compare --rounds N --out OUT` as the CLI runs it, each round's idle window IDLE_S seconds
(default 5, the harness's 15 being device time a lent machine rarely has). The harness rewrites its section after
every round, so a machine taken back mid-run leaves the rounds it made.

    python3 docs/bench36/gpu/compare.py OUT [ROUNDS]
"""

import dataclasses
import os
import sys

from services import cli
from services.bench import compare

idle_s = float(os.environ.get("IDLE_S", "5"))
full = compare.Plan.full.__func__  # type: ignore[attr-defined]
compare.Plan.full = classmethod(  # type: ignore[method-assign, assignment]
    lambda cls, rounds=6, scale_out=False: dataclasses.replace(full(cls, rounds, scale_out), idle_s=idle_s))
rounds = sys.argv[2] if len(sys.argv) > 2 else "5"
sys.argv = ["tokenbus", "bench", "compare", "--rounds", rounds, "--out", sys.argv[1]]
sys.exit(cli.main(sys.argv[1:]))
