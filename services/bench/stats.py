"""Percentiles and summaries, with the definitions `vllm bench serve` uses (linear interpolation)."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
