"""Runs one edge process."""

from __future__ import annotations

import logging

from services.edge.app import create_app
from services.edge.server import serve
from shared import eventloop
from shared.settings import Settings

log = logging.getLogger(__name__)


def run_edge(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("the edge needs --redis-url (or TOKENBUS_REDIS_URL)")
    log.info("edge listening on http://%s:%d", settings.host, settings.port)
    app = create_app(settings)
    eventloop.run(serve(app, settings, shutdown_timeout=settings.shutdown_grace_s), settings.event_loop)
