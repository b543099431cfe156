"""A job's engine outputs handed on as vLLM's output handler makes them (services.worker.engine_feed), against
vLLM's own per-request collector: what one job's conversion raises ends that job alone, never the output handler
that serves every job, and every output reaches the job in order."""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass
from typing import Any

import pytest
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.output_processor import RequestOutputCollector

from services.worker.engine_feed import JobFeed
from shared.protocol import bus

JOB_NAME: contextvars.ContextVar[str] = contextvars.ContextVar("job_name", default="")


@dataclass
class _Output:
    """What the feed reads of vLLM's RequestOutput."""

    text: str
    finished: bool = False


def _collector(request_id: str) -> Any:
    return RequestOutputCollector(RequestOutputKind.DELTA, request_id)


def _tokens(job: str) -> Any:
    return lambda out: [bus.Tokens(job=job, text=out.text, token_ids=[len(out.text)])]


async def test_every_output_reaches_the_job_in_order_and_it_ends_with_its_last_request() -> None:
    taken: list[str] = []
    feed = JobFeed(lambda event: taken.append(event.text), expected=2)
    first, second = _collector("a-0"), _collector("a-1")
    first.put(_Output("held before"))  # came while the request was being added
    feed.attach(first, _tokens("a"))
    feed.attach(second, _tokens("a"))
    first.put(_Output(" one"))
    first.put(_Output(" done", finished=True))
    assert not feed.ended.done()  # its other request still runs
    second.put(_Output(" two", finished=True))
    await asyncio.wait_for(feed.wait(), 1)
    assert taken == ["held before", " one", " done", " two"]


async def test_a_job_whose_output_fails_ends_alone_and_the_engine_goes_on_serving_the_others() -> None:
    kept: list[str] = []

    def broken(event: bus.Output) -> None:
        raise ValueError("a parser failed on this job's text")

    failing, fine = JobFeed(broken, expected=1), JobFeed(lambda event: kept.append(event.text), expected=1)
    failing_collector, fine_collector = _collector("bad"), _collector("good")
    failing.attach(failing_collector, _tokens("bad"))
    fine.attach(fine_collector, _tokens("good"))
    for step in range(3):  # the output handler's steps: neither put raises into it
        failing_collector.put(_Output(f" {step}"))
        fine_collector.put(_Output(f" {step}", finished=step == 2))
    with pytest.raises(ValueError, match="parser failed"):
        await asyncio.wait_for(failing.wait(), 1)
    await asyncio.wait_for(fine.wait(), 1)
    assert kept == [" 0", " 1", " 2"]


async def test_an_engine_failure_ends_the_job_with_it() -> None:
    feed = JobFeed(lambda event: None, expected=1)
    collector = _collector("x")
    feed.attach(collector, _tokens("x"))
    collector.put(RuntimeError("the engine core died"))
    with pytest.raises(RuntimeError, match="engine core died"):
        await asyncio.wait_for(feed.wait(), 1)


async def test_the_jobs_events_are_taken_in_its_own_context_whoever_delivers_them() -> None:
    """Its log records name its request, though the engine's output handler, another task, hands them over."""
    seen: list[str] = []
    JOB_NAME.set("job 7")
    feed = JobFeed(lambda event: seen.append(JOB_NAME.get()), expected=1)
    collector = _collector("y")
    feed.attach(collector, _tokens("y"))

    async def output_handler() -> None:
        JOB_NAME.set("the output handler")
        collector.put(_Output("x", finished=True))

    await asyncio.create_task(output_handler(), context=contextvars.Context())
    await asyncio.wait_for(feed.wait(), 1)
    assert seen == ["job 7"]
