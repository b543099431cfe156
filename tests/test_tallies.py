"""The metrics kept as plain numbers (those that change on every token or request) are scraped exactly as
prometheus_client's own Counter, Gauge and Histogram would show the same changes: same names, buckets, counts and
sums."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.runtime.metrics import TallyCounter, TallyGauge, TallyHistogram

BUCKETS = (0.001, 0.0025, 0.01, 0.1, 1)
GAPS = (0.0, 0.001, 0.0015, 0.0025, 0.02, 0.1, 0.5, 1.0, 3.0)


def test_a_tallied_histogram_scrapes_like_a_histogram() -> None:
    tallied, reference = CollectorRegistry(), CollectorRegistry()
    mine = TallyHistogram("gap_seconds", "Gaps", ["model"], buckets=BUCKETS, registry=tallied)
    theirs = Histogram("gap_seconds", "Gaps", ["model"], buckets=BUCKETS, registry=reference)
    for model in ("a", "b"):
        for gap in GAPS[: 5 if model == "a" else None]:
            mine.labels(model).observe(gap)
            theirs.labels(model).observe(gap)
    assert generate_latest(tallied) == generate_latest(reference)
    assert b'gap_seconds_bucket{le="0.001",model="a"} 2.0' in generate_latest(tallied)


def test_a_tallied_counter_scrapes_like_a_counter() -> None:
    tallied, reference = CollectorRegistry(), CollectorRegistry()
    mine, theirs = (TallyCounter("tokens", "Tokens", ["model"], registry=tallied),
                    Counter("tokens", "Tokens", ["model"], registry=reference))
    plain_mine, plain_theirs = (TallyCounter("writes", "Writes", registry=tallied),
                                Counter("writes", "Writes", registry=reference))
    for amount in (1, 4, 2):
        mine.labels("m").inc(amount)
        theirs.labels("m").inc(amount)
        plain_mine.inc()
        plain_theirs.inc()
    assert generate_latest(tallied) == generate_latest(reference)
    assert b'tokens_total{model="m"} 7.0' in generate_latest(tallied)


def test_a_tallied_gauge_scrapes_like_a_gauge() -> None:
    tallied, reference = CollectorRegistry(), CollectorRegistry()
    mine = TallyGauge("in_flight", "Requests in flight", ["model"], registry=tallied)
    theirs = Gauge("in_flight", "Requests in flight", ["model"], registry=reference)
    for gauge in (mine, theirs):
        gauge.labels("idle")
        for change in (1, 1, -1, 3):
            series = gauge.labels("busy")
            series.inc(change) if change > 0 else series.dec(-change)
    assert generate_latest(tallied) == generate_latest(reference)
    assert b'in_flight{model="busy"} 4.0' in generate_latest(tallied)
