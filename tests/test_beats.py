"""Periodic loops on beats: loops whose periods divide one another wake in the same turn of the event loop."""

from __future__ import annotations

import asyncio
import itertools

from shared.runtime import beats


async def _wakes(period_s: float, count: int, into: list[float]) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(count):
        await beats.sleep_to_beat(period_s)
        into.append(loop.time())


async def test_loops_whose_periods_divide_one_another_wake_together() -> None:
    fast: list[float] = []
    slow: list[float] = []
    await asyncio.sleep(0.013)  # the two start apart, and off the beat
    first = asyncio.create_task(_wakes(0.1, 8, fast))
    await asyncio.sleep(0.037)
    await asyncio.gather(first, _wakes(0.2, 3, slow))
    beat_of = {when: round(when / 0.1) for when in fast + slow}
    assert all(0 <= when - beat_of[when] * 0.1 < 0.02 for when in fast + slow), (fast, slow)  # woken on a beat
    assert {beat_of[when] for when in slow} <= {beat_of[when] for when in fast}, (fast, slow)  # with the fast loop
    steps = [beat_of[b] - beat_of[a] for a, b in itertools.pairwise(fast)]
    assert steps == [1] * 7, steps  # after its first, a loop sleeps whole periods

def test_a_round_due_just_after_a_beat_runs_on_it_and_one_due_well_after_on_the_next() -> None:
    assert beats.beat_at(12.0, 2.0) == 12.0
    assert beats.beat_at(12.2, 2.0) == 12.0  # within SLACK of a period: on the beat, 0.2 s early
    assert beats.beat_at(12.3, 2.0) == 14.0
    assert beats.beat_at(11.1, 2.0) == 12.0
    assert beats.come(11.95, 12.0, 2.0) and not beats.come(11.5, 12.0, 2.0)


def test_a_period_in_whole_beats_is_at_least_one_beat() -> None:
    assert beats.whole_beats(5.0, 2.0) == 4.0
    assert beats.whole_beats(1.0, 2.0) == 2.0
    assert beats.whole_beats(6.0, 2.0) == 6.0
