"""A job's engine requests, their outputs handed on as the engine makes them.

`AsyncLLM.generate` gives each request a task that its collector wakes on every engine step, and every generator
above it (the job's conversion, the runner's loop) runs once more per output: at many streams, a wake and a
generator chain per stream per step. Here each request's collector hands its outputs straight to the job's
conversion and on to its `take`, inside the output handler's own pass over the step; the job's task sleeps until
its requests have ended (or one failed). vllm serve wakes a task per stream per step; the worker wakes none. The
simulated engine hands its steps' tokens on the same way.

`take` runs in the job's context (its log records still name the request) and never waits; whatever it or the
conversion raises ends the job's feed with that exception, never the output handler, which serves every job.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

from services.worker.vllm_terms import deliver_outputs
from shared.protocol import bus

Take = Callable[[bus.Output], None]
"""Where a job's events go, one by one, as they are made: never waits."""

Convert = Callable[[Any], list[bus.Output]]
"""One engine request's output (vLLM's RequestOutput) as the job's events."""


class JobFeed:
    """The events of a job's `expected` engine requests, handed to `take` as they come; `ended` resolves once every
    request has finished, or with the first exception."""

    def __init__(self, take: Take, expected: int) -> None:
        self.take = take
        self.context = contextvars.copy_context()
        self.left = expected
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not expected:
            self.ended.set_result(None)

    def attach(self, collector: Any, convert: Convert) -> None:
        """Hands a vLLM request's outputs (`collector`: what AsyncLLM.add_request returned) through `convert` on
        from now on, an output it already holds first."""
        deliver_outputs(collector, lambda output: self._convert(output, convert))

    def _convert(self, output: Any, convert: Convert) -> None:
        if self.ended.done():
            return
        try:
            if isinstance(output, BaseException):  # the engine failed every request (its output handler died)
                raise output
            events = convert(output)
        except Exception as exc:
            self.fail(exc)
            return
        self.give(events, finished=output.finished)

    def give(self, events: list[bus.Output], finished: bool) -> None:
        """Hands on one output of a request (`finished`: its last); nothing once the feed has ended (failed, or
        closed: the rest is not the job's any more)."""
        if self.ended.done():
            return
        try:
            self.context.run(self._take_all, events)
        except Exception as exc:
            self.ended.set_exception(exc)
            return
        if finished:
            self.left -= 1
            if not self.left:
                self.ended.set_result(None)

    def _take_all(self, events: list[bus.Output]) -> None:
        for event in events:
            self.take(event)

    def fail(self, exc: Exception) -> None:
        """Ends the feed with `exc` (the engine failed its requests), unless it has ended already."""
        if not self.ended.done():
            self.ended.set_exception(exc)

    async def wait(self) -> None:
        """Until every request has finished; re-raises what ended the feed."""
        await self.ended

    def close(self) -> None:
        """Hands nothing more on (the job ended before its requests did: they are being aborted)."""
        if not self.ended.done():
            self.ended.cancel()
        elif not self.ended.cancelled():
            self.ended.exception()  # retrieved: it is being raised, or another error is
