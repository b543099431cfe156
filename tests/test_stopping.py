"""A shutdown that hangs past its bound ends the process, and its log says where each task was waiting."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time

import pytest

from shared.runtime import background
from tests.processes import ROOT

HANGING_SHUTDOWN = textwrap.dedent("""
    import asyncio, logging, time
    from shared.runtime import stopping

    async def held_forever(never: asyncio.Event) -> None:
        await never.wait()

    async def main() -> None:
        never = asyncio.Event()
        asyncio.create_task(held_forever(never), name="stuck-cleanup")
        stopping.arm("edge", {bound})
        await asyncio.sleep(0)
        {block}
        await never.wait()

    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
""")


def run_shutdown(bound: float, block: str = "pass") -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HANGING_SHUTDOWN.format(bound=bound, block=block)],
                          cwd=ROOT, capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stderr, time.monotonic() - started


def test_a_shutdown_past_its_bound_names_the_waiting_tasks_and_exits() -> None:
    status, log, _took = run_shutdown(0.5)
    assert status == 1
    assert "the edge did not stop within 0.5 s of its signal" in log
    # where each waits, down to the line: the task's own coroutine and the await inside it
    assert "still running: stuck-cleanup at " in log
    stuck = next(line for line in log.splitlines() if "still running: stuck-cleanup" in line)
    assert "held_forever" in stuck and "locks.py" in stuck  # Event.wait


def test_a_loop_blocked_past_its_bound_is_ended_too() -> None:
    status, log, took = run_shutdown(0.5, block="time.sleep(60)")
    assert status == 1
    assert "Timeout" in log and "Thread 0x" in log  # every thread's stack (faulthandler), the loop's at its sleep
    assert "still running" not in log  # the loop could not report
    assert took < 20


async def test_a_loop_that_swallows_its_cancel_is_named_and_left_behind(caplog: pytest.LogCaptureFixture) -> None:
    """A block's loops are cancelled on its way out; one that does not end (it swallowed the cancel, as a library
    may) is named in the log with where it waits, after background.STOP_WAIT_S, and the block is left all the same:
    before, its process's shutdown waited on it for good."""
    stubborn_started, forever = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        stubborn_started.set()
        while not forever.is_set():
            try:
                await forever.wait()
            except asyncio.CancelledError:
                continue  # swallowed

    async def polite() -> None:
        await forever.wait()

    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        async with background.looping(stubborn_loop=stubborn(), polite_loop=polite()):
            await stubborn_started.wait()
            left = [task for task in asyncio.all_tasks() if task.get_name() == "stubborn-loop"]
        took = time.monotonic() - started
    assert background.STOP_WAIT_S <= took < background.STOP_WAIT_S + 5
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 1 and warned[0].startswith("stubborn-loop still runs") and "stubborn" in warned[0]
    forever.set()  # it may end now
    await asyncio.wait(left, timeout=5)
