"""Periodic work in step: a loop that sleeps between rounds sleeps to the next multiple of its period on the
monotonic clock, so that loops whose periods divide one another wake together.

Every wake of an idle process costs CPU whatever it then does (docs/benchmarks.md measures one): an edge's
heartbeat, model directory, subscription check, lease renewal and memory poll each slept their own period from
their own start, and an idle edge woke for each of them and again for each reply. On beats they run in one wake
of the process, their round trips share the next, and since the monotonic clock is the host's, the edges and
workers on one host beat together and Redis reads their round trips in fewer wakes of its own.
"""

from __future__ import annotations

import asyncio
import math

SLACK = 0.125
"""A round due up to this part of a period after a beat runs on that beat, a little early, rather than on the next
one, nearly a period late."""


def beat_at(when: float, period_s: float) -> float:
    """The first multiple of `period_s` at or after `when` (less SLACK of a period), on the loop's clock."""
    return math.ceil((when - SLACK * period_s) / period_s) * period_s


def come(now: float, beat: float, period_s: float) -> bool:
    """Whether a timer set for `beat` has fired by `now` (a loop may run it a hair early)."""
    return now >= beat - SLACK * period_s / 2


def whole_beats(period_s: float, beat_s: float) -> float:
    """`period_s` rounded down to a whole number of beats of `beat_s`, at least one: a loop that must run at least
    every `period_s` runs on the beats of one that runs every `beat_s`."""
    return max(1, math.floor(period_s / beat_s + 1e-9)) * beat_s


async def sleep_to_beat(period_s: float) -> None:
    """Sleeps until the next multiple of `period_s` on the loop's clock that is more than SLACK of a period away: a
    round that ran on a beat sleeps a whole period, the first round's sleep is at most a period and SLACK."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    await asyncio.sleep(math.ceil((now + SLACK * period_s) / period_s) * period_s - now)
