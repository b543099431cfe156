"""Loops that live exactly as long as a block: started on entry, cancelled and awaited on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

from shared.runtime.stopping import awaits

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0
"""How long cancelled tasks have to end: one still running then (it swallowed its cancel, or waits in its cleanup)
is named in the log, with where it waits, and left behind rather than holding its process's shutdown."""


@contextlib.asynccontextmanager
async def looping(**loops: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Runs each named coroutine as a task (named after its keyword) for the lifetime of the block."""
    tasks = [asyncio.create_task(loop, name=name.replace("_", "-")) for name, loop in loops.items()]
    try:
        yield
    finally:
        await cancel_and_wait(tasks)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], wait_s: float = STOP_WAIT_S) -> None:
    """Cancels the tasks and waits for them to end, `wait_s` at most (see STOP_WAIT_S); what they raised is
    dropped."""
    running = list(tasks)
    for task in running:
        task.cancel()
    if not running:
        return
    done, stuck = await asyncio.wait(running, timeout=wait_s)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: asyncio would log it as never retrieved
    for task in sorted(stuck, key=lambda task: task.get_name()):
        log.warning("%s still runs %g s after its cancel, at %s; left behind", task.get_name(), wait_s,
                    " > ".join(awaits(task.get_coro())) or "?")
