"""A shutdown that hangs past its bound ends the process, and its log says where each task was waiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

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
