"""Runs a service's main coroutine on the event loop its settings name: uvloop (libuv's: fewer system calls and
cheaper wake-ups per streamed token than asyncio's own) or asyncio's."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    factory = None
    if event_loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
