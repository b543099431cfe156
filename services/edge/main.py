"""Runs one edge process."""

from __future__ import annotations

import asyncio
import logging

from services.edge.app import create_app
from services.edge.server import serve
from shared.settings import Settings

log = logging.getLogger(__name__)


def run_edge(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("the edge needs --redis-url (or TOKENBUS_REDIS_URL)")
    log.info("edge listening on http://%s:%d", settings.host, settings.port)
    asyncio.run(serve(create_app(settings), settings, shutdown_timeout=settings.shutdown_grace_s))
