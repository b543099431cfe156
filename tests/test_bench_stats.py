"""The paired bootstrap behind the tokenbus / `vllm serve` ratios, and the verdicts drawn from it."""

from __future__ import annotations

import math
import random

import pytest

from services.bench.stats import (
    LEAD,
    LEVEL,
    LOSS,
    UNJUDGED,
    Interval,
    bootstrap_mean,
    bootstrap_ratio_of_medians,
    paired_bootstrap_ratio,
    ratio_of_means,
    verdict,
)


def test_ratio_of_means_is_not_the_mean_of_ratios() -> None:
    assert ratio_of_means([1.0, 3.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert math.isnan(ratio_of_means([1.0], [0.0]))


def test_a_large_consistent_difference_is_bracketed_and_excludes_one() -> None:
    rng = random.Random(1)
    theirs = [100.0 * rng.uniform(0.95, 1.05) for _ in range(8)]
    ours = [1.3 * value * rng.uniform(0.98, 1.02) for value in theirs]
    ratio = paired_bootstrap_ratio(ours, theirs)
    assert ratio.low <= ratio.estimate <= ratio.high
    assert ratio.low < 1.3 < ratio.high
    assert ratio.low > 1.0
    assert verdict(ratio, higher_is_better=True) == LEAD


def test_the_mean_of_rounds_is_bracketed_by_an_interval_that_narrows_with_agreeing_rounds() -> None:
    spread = bootstrap_mean([0.5, 3.0, 1.0, 2.5, 0.8, 4.0])
    assert spread.estimate == pytest.approx(11.8 / 6) and spread.rounds == 6
    assert 0.5 < spread.low < spread.estimate < spread.high < 4.0
    agreeing = bootstrap_mean([1.9, 2.0, 2.1, 1.95, 2.05, 2.0])
    assert agreeing.high - agreeing.low < (spread.high - spread.low) / 5
    assert math.isnan(bootstrap_mean([1.0, math.nan]).estimate)
    with pytest.raises(ValueError):
        bootstrap_mean([])


def test_identical_samples_give_an_interval_around_one() -> None:
    samples = [90.0, 110.0, 95.0, 105.0, 100.0, 120.0]
    ratio = paired_bootstrap_ratio(samples, list(samples))
    assert (ratio.estimate, ratio.low, ratio.high) == pytest.approx((1.0, 1.0, 1.0))
    assert verdict(ratio, higher_is_better=True) == LEVEL


def test_noise_without_a_difference_stays_level() -> None:
    rng = random.Random(2)
    ours = [rng.gauss(100, 10) for _ in range(6)]
    theirs = [rng.gauss(100, 10) for _ in range(6)]
    ratio = paired_bootstrap_ratio(ours, theirs)
    assert ratio.low < 1.0 < ratio.high


def test_rounds_are_resampled_in_pairs() -> None:
    # Round-to-round drift is large but both systems drift together: paired, the ratio is exactly 2 in every
    # resample; had the rounds been drawn independently for each system the interval would be wide.
    theirs = [10.0, 100.0, 1000.0, 50.0, 500.0]
    ratio = paired_bootstrap_ratio([2 * value for value in theirs], theirs)
    assert (ratio.low, ratio.high) == pytest.approx((2.0, 2.0))


def test_the_interval_is_reproducible_and_percentile_based() -> None:
    ours, theirs = [1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0]
    assert paired_bootstrap_ratio(ours, theirs) == paired_bootstrap_ratio(ours, theirs)
    narrow = paired_bootstrap_ratio(ours, theirs, confidence=0.5)
    wide = paired_bootstrap_ratio(ours, theirs, confidence=0.99)
    assert wide.low <= narrow.low <= narrow.high <= wide.high
    assert wide.low >= 0.5 and wide.high <= 2.0  # no resample can beat all-lowest or all-highest rounds


def test_unpaired_or_empty_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap_ratio([], [])


def test_too_few_rounds_give_no_verdict_however_clear_the_difference() -> None:
    ratio = paired_bootstrap_ratio([2.0, 2.2, 2.1, 2.0], [1.0, 1.1, 1.0, 1.0])
    assert ratio.low > 1.0 and ratio.rounds == 4
    assert verdict(ratio, higher_is_better=True) == UNJUDGED


def test_a_round_without_a_figure_gives_no_claim() -> None:
    ratio = paired_bootstrap_ratio([1.0, math.nan, 1.0, 1.0, 1.0], [2.0] * 5)
    assert math.isnan(ratio.estimate)
    assert verdict(ratio, higher_is_better=False) == LEVEL


@pytest.mark.parametrize(
    ("interval", "higher_is_better", "expected"),
    [
        (Interval(1.2, 1.1, 1.3, 6), True, LEAD),  # more throughput, surely
        (Interval(1.2, 1.1, 1.3, 6), False, LOSS),  # more latency, surely
        (Interval(0.8, 0.7, 0.9, 6), True, LOSS),
        (Interval(0.8, 0.7, 0.9, 6), False, LEAD),
        (Interval(1.05, 0.99, 1.1, 6), True, LEVEL),
        (Interval(0.95, 0.9, 1.01, 6), False, LEVEL),
        (Interval(1.0, 1.0, 1.2, 6), True, LEVEL),  # an interval that touches 1.0 does not exclude it
    ],
)
def test_the_verdict_needs_an_interval_that_excludes_one(interval: Interval, higher_is_better: bool,
                                                         expected: str) -> None:
    assert verdict(interval, higher_is_better) == expected


def test_runs_that_disagree_from_round_to_round_widen_the_ratio_of_medians() -> None:
    # Each run's requests agree closely, so pooled they would give a narrow interval; the rounds disagree (aware
    # 0.5x of blind in one, 1.5x in the other), and the interval over rounds and requests spans both.
    rng = random.Random(3)
    blind = [[rng.gauss(100, 2) for _ in range(200)] for _ in range(2)]
    aware = [[rng.gauss(50, 1) for _ in range(200)], [rng.gauss(150, 3) for _ in range(200)]]
    across = bootstrap_ratio_of_medians(aware, blind)
    assert across.rounds == 2 and across.low < 0.6 and across.high > 1.4
    within = bootstrap_ratio_of_medians(aware[:1], blind[:1])
    assert 0.45 < within.low <= within.estimate <= within.high < 0.55
