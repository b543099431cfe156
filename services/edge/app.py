"""The edge application: `create_app(settings)` wires Redis, the event relay and the routes."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from services.edge import handlers, openapi
from services.edge.directory import ModelDirectory
from services.edge.formats import tgi
from services.edge.formats.base import openai_error
from services.edge.gateway import Gateway
from services.edge.relay import EventRelay, Timing, running
from services.edge.sse import ClientGone
from services.edge.state import DRAINING, GATEWAY, REDIS, SETTINGS, STORE
from services.edge.store import ResponseStore
from shared import fairshare, keys, metrics, redis_clients
from shared.errors import MethodNotAllowed, NotFound, PayloadTooLarge, TokenbusError, Unavailable
from shared.settings import Settings

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


TGI_ROUTES = frozenset({"/", "/generate", "/generate_stream", "/info"})
WITHOUT_REDIS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "unmatched"})
"""Routes that answer during a Redis outage; every other one is refused at once with a 503."""
"""Routes that answer errors in TGI's shape and with TGI's status codes."""


RETRY_AFTER_S = 1
"""What a 503 or 429 tells a client to wait before trying again, unless its error knows better."""


def _error_response(route: str, error: TokenbusError) -> web.Response:
    if route in TGI_ROUTES:
        status, _type = tgi.error_status(error)
        body = tgi.tgi_error(error)
    else:
        status, body = error.status, openai_error(error)
    headers = {"Retry-After": str(error.retry_after_s or RETRY_AFTER_S)} if status in (429, 503) else None
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _http_error(request: web.Request, exc: web.HTTPException) -> TokenbusError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge(f"The request body is larger than {request.app[SETTINGS].max_body_bytes} bytes.")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
    if isinstance(exc, web.HTTPNotFound):
        return NotFound(f"No route for {request.method} {request.path}.")
    return TokenbusError(exc.reason)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into the API's error shape; nothing leaves as an HTML page or a bare 500."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource else "unmatched"
    response: web.StreamResponse
    try:
        if route not in WITHOUT_REDIS:
            request.app[GATEWAY].check_redis()
        response = await handler(request)
    except (RedisError, OSError) as exc:  # the one place Redis failures become an API error
        log.warning("redis failed on %s: %s", route, type(exc).__name__)
        response = _error_response(route, Unavailable("The service cannot reach its queue; try again shortly."))
    except TokenbusError as exc:
        response = _error_response(route, exc)
    except web.HTTPException as exc:
        response = _error_response(route, _http_error(request, exc))
    except ClientGone:
        # the client will not read an answer; its job was cancelled on the way out
        metrics.CLIENT_DISCONNECTS.inc()
        response = web.Response(status=499)
    except Exception:
        log.exception("unexpected failure on %s", route)
        response = _error_response(route, TokenbusError("The server failed to handle the request."))
    metrics.REQUESTS.labels(route, str(response.status)).inc()
    return response


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers, at least one worker is alive, and the edge is not draining."""
    if request.app[DRAINING].is_set():
        return web.json_response({"status": "draining"}, status=503)
    if request.app[GATEWAY].relay.redis_down():
        return web.json_response({"status": "unavailable", "reason": "redis unreachable"}, status=503)
    try:
        await request.app[REDIS].ping()
        models = await request.app[GATEWAY].directory.refresh()
    except (RedisError, OSError) as exc:
        return web.json_response({"status": "unavailable", "reason": f"redis: {type(exc).__name__}"}, status=503)
    if not models:
        return web.json_response({"status": "unavailable", "reason": "no live worker"}, status=503)
    return web.json_response({"status": "ready", "models": sorted(models)})


async def prometheus(request: web.Request) -> web.Response:
    response = web.Response(body=generate_latest())
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return response


def create_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[DRAINING] = asyncio.Event()
    app.cleanup_ctx.append(_bus)
    for prefix in ("/v1", "/v3"):  # /v3: OpenVINO Model Server's paths for the same API
        app.router.add_post(f"{prefix}/chat/completions", handlers.chat_completions)
        app.router.add_post(f"{prefix}/completions", handlers.text_completions)
        app.router.add_post(f"{prefix}/responses", handlers.create_response)
        app.router.add_get(f"{prefix}/responses/{{response_id}}", handlers.get_response)
        app.router.add_delete(f"{prefix}/responses/{{response_id}}", handlers.delete_response)
        app.router.add_post(f"{prefix}/embeddings", handlers.create_embeddings)
        app.router.add_get(f"{prefix}/models", handlers.list_models)
        app.router.add_get(f"{prefix}/streams/{{stream_id}}", handlers.resume_stream)
    app.router.add_post("/serving-endpoints/{name}/invocations", handlers.invocations)
    app.router.add_post("/generate", handlers.generate)
    app.router.add_post("/generate_stream", handlers.generate_stream)
    app.router.add_post("/", handlers.compat_generate)
    app.router.add_get("/info", handlers.tgi_info)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/openapi.json", openapi.serve)
    return app


async def _bus(app: web.Application) -> AsyncIterator[None]:
    """Opens the edge's fixed set of Redis connections and runs its event relay."""
    settings = app[SETTINGS]
    edge_id = uuid.uuid4().hex[:12]
    name = f"tokenbus-edge-{edge_id}"  # shows in CLIENT LIST, so operators can count an edge's connections
    commands = redis_clients.pooled(settings.redis_url, name, settings.redis_pool_size)
    reader = redis_clients.dedicated(settings.redis_url, name)  # the relay bounds each read itself
    directory = ModelDirectory(commands)
    timing = Timing(heartbeat_interval_s=settings.heartbeat_interval_s, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                    redis_down_after_s=settings.redis_down_after_s, max_buffered_events=settings.max_buffered_events)
    relay = EventRelay(reader, commands, keys.events_stream(edge_id), timing, directory.alive)
    app[REDIS] = commands
    app[GATEWAY] = Gateway(commands, relay, directory, fairshare.for_settings(commands, settings),
                           settings.resume_window_s)
    app[STORE] = ResponseStore(commands, settings.response_ttl_s)
    async with running(relay), directory.running():
        log.info("edge %s reads its events from %s", edge_id, relay.stream)
        yield
    await reader.aclose()
    await commands.aclose()
