"""Runs one worker process: the engine, the worker loop, signal handling and its metrics endpoint."""

from __future__ import annotations

import asyncio
import logging
import signal

from services.worker.engine import VllmEngine
from services.worker.models import resolve_model_dir
from services.worker.parsing.formats import tool_format
from services.worker.parsing.reasoning import reasoning_format
from services.worker.sim import SimEngine
from services.worker.worker import Worker
from shared.runtime import eventloop, exposition, gcheap, metrics, stopping
from shared.runtime.settings import Settings

log = logging.getLogger(__name__)

STOP_MARGIN_S = 60.0
"""What a stopping worker has past its grace (--worker-grace-s) to hand its jobs over, close its connections and
shut its engine down, before it is ended (shared.runtime.stopping): each of those steps has its own deadline."""


def run_worker(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("the worker needs --redis-url (or TOKENBUS_REDIS_URL)")
    for name, check in (("tool_parser", tool_format), ("reasoning_parser", reasoning_format)):
        try:
            check(getattr(settings, name))
        except ValueError as exc:
            raise SystemExit(f"invalid setting {name}: {exc}") from None
    engine: VllmEngine | SimEngine
    if settings.engine == "sim":
        log.warning("serving %s with the SIMULATED engine (benchmarks and fault tests only)", settings.model)
        engine = SimEngine(settings)
    else:
        engine = VllmEngine(settings, resolve_model_dir(settings.model_dir, settings.task))
    if not eventloop.run(_serve(settings, engine), settings.event_loop):
        raise SystemExit(1)


async def _serve(settings: Settings, engine: VllmEngine | SimEngine) -> bool:
    """Serves until SIGINT or SIGTERM (True), or until a loop of the worker died (False)."""
    async with exposition.serving(settings, metrics.WORKER, "worker"):
        log.info("starting the %s engine", settings.engine)
        engine.start()  # in the loop: vLLM's output handler binds to the running loop
        await engine.prepare()
        return await _run(Worker(settings, engine), engine)


async def _run(worker: Worker, engine: VllmEngine | SimEngine) -> bool:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        gcheap.freeze_startup_heap()  # the engine is up; no job has arrived yet
        await worker.start()
        stopped, crashed = asyncio.create_task(stop.wait()), asyncio.create_task(worker.crashed.wait())
        await asyncio.wait([stopped, crashed], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        crashed.cancel()
        log.info("stopping")
        stopping.arm("worker", worker.settings.worker_grace_s + STOP_MARGIN_S)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await worker.stop()
        await engine.close()
    return not worker.crashed.is_set()
