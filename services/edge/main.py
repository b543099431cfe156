"""Runs one edge process."""

from __future__ import annotations

import logging

from aiohttp import web

from services.edge.app import create_app
from shared.settings import Settings

log = logging.getLogger(__name__)


def run_edge(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("the edge needs --redis-url (or TOKENBUS_REDIS_URL)")
    log.info("edge listening on http://%s:%d", settings.host, settings.port)
    web.run_app(create_app(settings), host=settings.host, port=settings.port, print=None,
                access_log=None, shutdown_timeout=5.0)
