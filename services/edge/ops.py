"""The operational routes: liveness and readiness. They need no key and answer during a Redis outage
(readiness then says why it is not ready). The metrics are not among them: see shared/runtime/exposition.py."""

from __future__ import annotations

from aiohttp import web

from services.edge.redis_boundary import REDIS_FAILURES
from services.edge.state import DRAINING, GATEWAY, REDIS
from shared.runtime.settings import Settings


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when the edge is not draining, Redis answers, and every model the deployment serves has had a live
    worker since the edge started. A model whose workers all go later (a restart) does not make the edge unready:
    its requests get 503 model_unavailable with Retry-After, which SDKs retry, and the other models are served on
    (an unready edge would take every model's traffic down with it). `?model=NAME`: whether that model has a live
    worker now. The answer names no other model (it needs no key; /v1/models shows a key what it may use)."""
    if request.app[DRAINING].is_set():
        return web.json_response({"status": "draining"}, status=503)
    if request.app[GATEWAY].relay.redis_down():
        return web.json_response({"status": "unavailable", "reason": "redis unreachable"}, status=503)
    try:
        await request.app[REDIS].ping()
        models = await request.app[GATEWAY].directory.refresh()
    except REDIS_FAILURES as exc:
        return web.json_response({"status": "unavailable", "reason": f"redis: {type(exc).__name__}"}, status=503)
    if "model" in request.query:
        if request.query["model"] not in models:
            return web.json_response({"status": "unavailable", "reason": "no live worker"}, status=503)
        return web.json_response({"status": "ready"})
    directory = request.app[GATEWAY].directory
    if not directory.up():
        waiting = len(set(directory.expected) - directory.came_up)
        return web.json_response({"status": "unavailable", "reason": "no live worker yet",
                                  "waiting_for_models": waiting}, status=503)
    return web.json_response({"status": "ready"})


def expected_models(settings: Settings) -> list[str]:
    return [m for m in (part.strip() for part in settings.ready_models.split(",")) if m] or [settings.model]
