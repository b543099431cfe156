"""Percentiles and summaries, with the definitions `vllm bench serve` uses (linear interpolation), and the
paired bootstrap that says whether two systems differ by more than the noise between rounds."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        mean = sum(values) / len(values) if values else math.nan
        return cls(mean, percentile(values, 50), percentile(values, 90), percentile(values, 99))

    def scaled(self, factor: float) -> Summary:
        return Summary(self.mean * factor, self.p50 * factor, self.p90 * factor, self.p99 * factor)


def ratio_of_means(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """mean(ours) / mean(theirs); NaN where the denominator is zero rather than an exception mid-report."""
    theirs_total = sum(theirs)
    if not ours or not theirs or theirs_total == 0:
        return math.nan
    return (sum(ours) / len(ours)) / (theirs_total / len(theirs))


@dataclass(frozen=True)
class Interval:
    """A point estimate with the low and high ends of its confidence interval, from `rounds` paired samples."""

    estimate: float
    low: float
    high: float
    rounds: int


def paired_bootstrap_ratio(ours: Sequence[float], theirs: Sequence[float], *, resamples: int = 4000,
                           confidence: float = 0.95, seed: int = 0) -> Interval:
    """The ratio of the means of two paired samples, and its percentile-bootstrap interval.

    `ours[i]` and `theirs[i]` were measured in the same round, so a resample draws round indices with
    replacement and takes both systems' figures of the drawn rounds: drift between rounds then moves
    numerator and denominator together instead of widening the interval. The seed is fixed so that the
    same figures always give the same interval."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired samples need the same, non-zero length (got {len(ours)} and {len(theirs)})")
    rounds = len(ours)
    if not all(math.isfinite(value) for value in (*ours, *theirs)):
        return Interval(math.nan, math.nan, math.nan, rounds)  # a round without a figure (all failed): no claim
    low, high = _bootstrap(rounds, lambda picks: ratio_of_means([ours[i] for i in picks], [theirs[i] for i in picks]),
                           resamples, confidence, seed)
    return Interval(ratio_of_means(ours, theirs), low, high, rounds)


def bootstrap_mean(values: Sequence[float], *, resamples: int = 4000, confidence: float = 0.95,
                   seed: int = 0) -> Interval:
    """The mean of per-round figures (each a difference already paired within its round), and its
    percentile-bootstrap interval over the rounds."""
    if not values:
        raise ValueError("a mean needs at least one round")
    rounds = len(values)
    if not all(math.isfinite(value) for value in values):
        return Interval(math.nan, math.nan, math.nan, rounds)
    low, high = _bootstrap(rounds, lambda picks: sum(values[i] for i in picks) / rounds, resamples, confidence, seed)
    return Interval(sum(values) / rounds, low, high, rounds)


def bootstrap_ratio_of_medians(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]], *,
                               resamples: int = 2000, confidence: float = 0.95, seed: int = 0) -> Interval:
    """median(ours) / median(theirs) of the requests of paired rounds (round i of each ran side by side), and its
    two-level percentile-bootstrap interval: each resample draws round indices with replacement (a round's two runs
    together), then each drawn run's requests with replacement, so that the interval holds the runs' differences
    from round to round as well as the requests' within one run."""
    pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if a and b]
    if not pairs:
        return Interval(math.nan, math.nan, math.nan, 0)
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded resampling

    def ratio(chosen: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float:
        below = percentile([v for _, b in chosen for v in b], 50)
        return percentile([v for a, _ in chosen for v in a], 50) / below if below else math.nan

    def resample() -> list[tuple[list[float], list[float]]]:
        return [(rng.choices(a, k=len(a)), rng.choices(b, k=len(b))) for a, b in rng.choices(pairs, k=len(pairs))]

    estimates = [ratio(resample()) for _ in range(resamples)]
    tail = (1 - confidence) / 2 * 100
    return Interval(ratio(pairs), percentile(estimates, tail), percentile(estimates, 100 - tail), len(pairs))


def _bootstrap(rounds: int, statistic: Callable[[list[int]], float], resamples: int, confidence: float,
               seed: int) -> tuple[float, float]:
    """The percentile-bootstrap interval of `statistic` over resamples of the round indices (drawn with
    replacement, `rounds` per resample; the seed is fixed so that the same figures give the same interval)."""
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded workload
    estimates = [statistic([rng.randrange(rounds) for _ in range(rounds)]) for _ in range(resamples)]
    tail = (1 - confidence) / 2 * 100
    return percentile(estimates, tail), percentile(estimates, 100 - tail)


MIN_ROUNDS = 5
"""Fewer rounds give too few distinct resamples (2 rounds give 3) for the interval's ends to mean anything."""
LEAD, LOSS, LEVEL = "lead", "loss", "level (within noise)"
UNJUDGED = f"not judged (fewer than {MIN_ROUNDS} rounds)"


def verdict(ratio: Interval, higher_is_better: bool) -> str:
    """`lead` or `loss` only when the interval leaves out 1.0 (no difference); otherwise `level`; no verdict at
    all from fewer than `MIN_ROUNDS` rounds."""
    if ratio.rounds < MIN_ROUNDS:
        return UNJUDGED
    if ratio.low > 1.0:
        return LEAD if higher_is_better else LOSS
    if ratio.high < 1.0:
        return LOSS if higher_is_better else LEAD
    return LEVEL
