"""Runs one edge process."""

from __future__ import annotations

import logging
import resource

from services.edge.app import create_app
from services.edge.server import serve
from shared.runtime import eventloop
from shared.runtime.settings import Settings

log = logging.getLogger(__name__)


def run_edge(settings: Settings) -> None:
    if not settings.redis_url:
        raise SystemExit("the edge needs --redis-url (or TOKENBUS_REDIS_URL)")
    log.info("edge listening on http://%s:%d (up to %d open files)", settings.host, settings.port,
             raise_open_files_limit())
    app = create_app(settings)
    eventloop.run(serve(app, settings, shutdown_timeout=settings.shutdown_grace_s), settings.event_loop)


OPEN_FILES_CEILING = 1 << 20
"""Where the open-files limit stops when the hard limit is unlimited (the kernel's default fs.nr_open)."""


def raise_open_files_limit() -> int:
    """Raises the soft open-files limit to the hard one, and returns it: every client connection is a file
    descriptor, and a soft limit of 1024 (systemd's and some container runtimes' default) would cap an edge at
    about a thousand streams, far below what its memory and CPU hold (docs/capacity.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft
