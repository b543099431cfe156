"""Loops that live exactly as long as a block: started on entry, cancelled and awaited on the way out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def looping(**loops: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Runs each named coroutine as a task (named after its keyword) for the lifetime of the block."""
    tasks = [asyncio.create_task(loop, name=name.replace("_", "-")) for name, loop in loops.items()]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
