"""The harness's own logic: percentiles, distributions, arrivals, SSE timing, summaries."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from services.bench.client import Timing, read_frame
from services.bench.load import Load, summarize
from services.bench.stats import Summary, percentile
from services.bench.workload import Distribution, poisson_gaps, requests


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_like_numpy(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0


def test_summary_and_scaling() -> None:
    summary = Summary.of([0.001, 0.002, 0.003]).scaled(1000)
    assert (summary.mean, summary.p50) == pytest.approx((2.0, 2.0))


@pytest.mark.parametrize(
    ("text", "low", "high"), [("fixed:16", 16, 16), ("uniform:10-20", 10, 20), ("normal:100,1", 90, 110)]
)
def test_distributions_draw_in_range(text: str, low: int, high: int) -> None:
    rng = random.Random(0)
    draws = [Distribution.parse(text).draw(rng) for _ in range(200)]
    assert low <= min(draws) and max(draws) <= high


@pytest.mark.parametrize("text", ["fixed", "uniform:5", "normal:1", "zipf:2", "fixed:x"])
def test_bad_distributions_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="distribution"):
        Distribution.parse(text)


def test_requests_are_reproducible_and_sized() -> None:
    first = requests(5, Distribution("fixed", 12), Distribution("uniform", 5, 9), seed=3)
    assert first == requests(5, Distribution("fixed", 12), Distribution("uniform", 5, 9), seed=3)
    assert all(len(r.prompt.split()) == 12 and 5 <= r.max_tokens <= 9 for r in first)


def test_poisson_gaps_have_the_asked_rate() -> None:
    gaps = poisson_gaps(20.0, seed=1)
    sample = [next(gaps) for _ in range(4000)]
    assert statistics.mean(sample) == pytest.approx(1 / 20, rel=0.1)
    assert next(poisson_gaps(float("inf"), seed=1)) == 0.0


def test_chat_frames_are_timed() -> None:
    timing = Timing(start=10.0)
    read_frame("chat", b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', timing, 10.1)
    read_frame("chat", b'{"choices":[{"index":0,"delta":{"content":"Hi"}}]}', timing, 10.3)
    read_frame("chat", b'{"choices":[{"index":0,"delta":{"content":" there"}}]}', timing, 10.4)
    read_frame("chat", b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}', timing, 10.5)
    read_frame("chat", b"[DONE]", timing, 10.6)
    timing.end = 10.6
    assert timing.ttfc == pytest.approx(0.1) and timing.ttft == pytest.approx(0.3)
    assert timing.itls == pytest.approx([0.1])
    assert (timing.output_tokens, timing.prompt_tokens) == (3, 5)
    assert timing.tpot == pytest.approx((0.6 - 0.3) / 2)


def test_completion_frames_and_errors() -> None:
    timing = Timing(start=0.0)
    read_frame("completions", b'{"choices":[{"index":0,"text":"a"}]}', timing, 0.2)
    read_frame("completions", b'{"error":{"message":"boom"}}', timing, 0.3)
    assert timing.content == [0.2]
    assert timing.error is not None and "boom" in timing.error
    assert not timing.ok


def test_summary_counts_failures_and_goodput() -> None:
    fast = Timing(start=0.0, content=[0.1, 0.2, 0.3], end=0.3, output_tokens=3)
    slow = Timing(start=0.0, content=[3.0, 3.1], end=3.1, output_tokens=2)
    failed = Timing(start=0.0, error="HTTP 500")
    result = summarize("x", Load("http://h", "m", slo_ttft_ms=1000), [fast, slow, failed], duration_s=2.0)
    assert (result.requests, result.failed) == (3, 1)
    assert result.output_throughput == pytest.approx(5 / 2.0)
    assert result.goodput == pytest.approx(1 / 2.0)
    assert result.ttft_ms.p50 == pytest.approx((100 + 3000) / 2)


def test_the_vllm_bench_summary_is_cut_out_of_its_noise() -> None:
    from services.bench.compare import result_block

    table = "============ Serving Benchmark Result ============\nSuccessful requests: 16\n" + "=" * 50
    assert result_block("warming up\n" + table + "\n 6%|| 1/16 progress\nleaked type") == table
