"""The one Prometheus endpoint of a process (an edge's or a worker's): its registry on its own port, apart from
the API, since the metrics name tenants and their volumes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)


class MetricsSettings(Protocol):
    """The settings the endpoint reads (Settings has them)."""

    @property
    def host(self) -> str: ...
    @property
    def metrics_host(self) -> str: ...
    @property
    def metrics_port(self) -> int: ...


def metrics_host(settings: MetricsSettings) -> str:
    """Where the metrics endpoint listens: --metrics-host, or the API's --host."""
    return settings.metrics_host or settings.host


@contextlib.asynccontextmanager
async def serving(settings: MetricsSettings, registry: CollectorRegistry, role: str) -> AsyncIterator[None]:
    """Serves `registry` on --metrics-port (none when 0) from the process's own loop: prometheus_client's server
    thread wakes twice a second to poll, and takes the interpreter's lock from the loop to do so."""
    if not settings.metrics_port:
        yield
        return

    async def exposition(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", exposition)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        host = metrics_host(settings)
        await web.TCPSite(runner, host, settings.metrics_port).start()
        log.info("%s metrics on http://%s:%d/metrics", role, host, settings.metrics_port)
        yield
    finally:
        await runner.cleanup()
