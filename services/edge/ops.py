"""The operational routes: liveness and readiness. They need no key and answer during a Redis outage
(readiness then says why it is not ready). The metrics are not among them: see shared/runtime/exposition.py."""

from __future__ import annotations

from aiohttp import web

from services.edge.redis_boundary import REDIS_FAILURES
from services.edge.state import DRAINING, GATEWAY, REDIS, SETTINGS
from shared.runtime.settings import Settings


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers, every model the deployment serves (or the one `?model=` names) has a live
    worker, and the edge is not draining."""
    if request.app[DRAINING].is_set():
        return web.json_response({"status": "draining"}, status=503)
    if request.app[GATEWAY].relay.redis_down():
        return web.json_response({"status": "unavailable", "reason": "redis unreachable"}, status=503)
    try:
        await request.app[REDIS].ping()
        models = await request.app[GATEWAY].directory.refresh()
    except REDIS_FAILURES as exc:
        return web.json_response({"status": "unavailable", "reason": f"redis: {type(exc).__name__}"}, status=503)
    settings = request.app[SETTINGS]
    wanted = [request.query["model"]] if "model" in request.query else expected_models(settings)
    if missing := [m for m in wanted if m not in models]:
        return web.json_response({"status": "unavailable", "reason": "no live worker",
                                  "missing": missing, "models": sorted(models)}, status=503)
    return web.json_response({"status": "ready", "models": sorted(models)})


def expected_models(settings: Settings) -> list[str]:
    return [m for m in (part.strip() for part in settings.ready_models.split(",")) if m] or [settings.model]
