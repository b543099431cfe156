"""Keeps the garbage collector off the heap a service builds at startup, as `vllm serve` does once it is up."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collects what startup left behind, then moves every object alive now out of the collector's generations:
    a full collection later visits only what serving made, not the modules, the app or the engine. A full
    collection takes time in proportion to the objects it visits, and a startup heap is large (an edge's holds
    its modules and app; a worker's with vLLM loaded, many times more): such a collection can come during a
    burst of requests, and it stalls every stream of its process while it runs. Startup objects freed later are
    still freed (by their reference counts); only cycles among them are never collected."""
    gc.collect()
    gc.freeze()
    log.debug("the startup heap (%d objects) is out of the collector's way", gc.get_freeze_count())


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for a block that makes many objects at once and runs nothing else meanwhile (decoding a
    request body): each of CPython's collections triggered mid-way visits every container made so far, so a body
    of millions of small arrays took ~10x the time of making them (2 s for 10 MB on this machine, the event loop
    held all along). What the block made is collected, if ever needed, after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
