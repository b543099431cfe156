"""A process's shutdown, bounded: armed at the signal, it names what still runs once the bound passes, and ends
the process. An orchestrator kills a process that outlives its stop grace anyway; here the log says why it did."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
from collections.abc import Coroutine, Generator
from typing import Any

log = logging.getLogger(__name__)

STOP_MARGIN_S = 10.0
"""What a shutdown has past its drain (its grace) to end what was cut and close its connections."""
BLOCKED_LOOP_S = 5.0
"""Past the bound, how long the loop has to report before it counts as blocked: the interpreter then writes
every thread's stack to stderr and exits (faulthandler)."""
DEEPEST_AWAIT = 16
"""The awaits followed into a task (its coroutine, what that awaits, and on)."""


def arm(role: str, bound_s: float) -> None:
    """From now, the running loop's process has `bound_s` to end: past it, each task still running is logged
    with where it waits, and the process exits with status 1."""
    asyncio.get_running_loop().call_later(bound_s, _overran, role, bound_s)
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # no stderr to write to: the loop's bound alone
        faulthandler.dump_traceback_later(bound_s + BLOCKED_LOOP_S, exit=True)


def _overran(role: str, bound_s: float) -> None:
    tasks = sorted(asyncio.all_tasks(), key=lambda task: task.get_name())
    log.error("the %s did not stop within %g s of its signal; %d tasks still run", role, bound_s, len(tasks))
    for task in tasks:
        log.error("still running: %s at %s", task.get_name(), " > ".join(awaits(task.get_coro())) or "?")
    logging.shutdown()
    os._exit(1)


def awaits(coroutine: Coroutine[Any, Any, Any] | Generator[Any, Any, Any] | None) -> list[str]:
    """Where a suspended coroutine waits, outermost first (file:line function, no values)."""
    places: list[str] = []
    awaited: Any = coroutine
    while awaited is not None and len(places) < DEEPEST_AWAIT:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None) \
            or getattr(awaited, "ag_frame", None)
        if frame is not None:
            places.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None) \
            or getattr(awaited, "ag_await", None)
    return places
