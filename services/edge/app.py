"""The edge application: `create_app(settings)` wires Redis, the event relay and the routes."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from services.edge import pump
from services.edge.formats import chat
from services.edge.formats.base import decode, encode, openai_error, unknown_fields
from services.edge.gateway import Gateway
from services.edge.relay import EventRelay, running
from services.edge.sse import ClientGone
from shared import bus, keys, metrics
from shared.errors import InvalidRequest, NotFound, TokenbusError
from shared.settings import Settings

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", Settings)
GATEWAY = web.AppKey("gateway", Gateway)
REDIS = web.AppKey("redis", aioredis.Redis)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(error: TokenbusError) -> web.Response:
    return web.Response(status=error.status, body=openai_error(error), content_type="application/json")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into the API's error shape; nothing leaves as an HTML page or a bare 500."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except TokenbusError as exc:
        status = exc.status
        return _error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        status = 413
        limit = request.app[SETTINGS].max_body_bytes
        error = InvalidRequest(f"The request body is larger than {limit} bytes.", code="body_too_large")
        return web.Response(status=413, body=openai_error(error), content_type="application/json")
    except web.HTTPException as exc:
        status = exc.status
        if exc.status == 404:
            return _error_response(NotFound(f"No route for {request.method} {request.path}."))
        if exc.status == 405:
            error = InvalidRequest(f"Method {request.method} is not allowed on {request.path}.")
            return web.Response(status=405, body=openai_error(error), content_type="application/json")
        raise
    except ClientGone:
        # the client will not read an answer; its job was cancelled on the way out
        status = 499
        metrics.CLIENT_DISCONNECTS.inc()
        return web.Response(status=499)
    except Exception:
        log.exception("unexpected failure on %s", route)
        return _error_response(TokenbusError("The server failed to handle the request."))
    finally:
        metrics.REQUESTS.labels(route, str(status)).inc()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    settings, gateway = request.app[SETTINGS], request.app[GATEWAY]
    started = time.monotonic()
    body = await request.read()
    req = decode(body, chat.ChatCompletionRequest)
    if ignored := unknown_fields(body, chat.ChatCompletionRequest):
        metrics.UNKNOWN_FIELDS.labels("chat").inc(len(ignored))
    await gateway.require_model(req.model)
    job_id = f"chatcmpl-{uuid.uuid4().hex}"
    deadline = started + settings.request_timeout_s
    job = chat.to_job(req, job_id=job_id, reply_to=gateway.relay.stream,
                      deadline_ms=bus.now_ms() + int(settings.request_timeout_s * 1000))
    renderer = chat.ChatRenderer(req, response_id=job_id, created=int(time.time()))
    metrics.IN_FLIGHT.inc()
    try:
        async with gateway.submit(job, deadline) as events:
            return await pump.respond(request, events, renderer, stream=req.stream, route="chat",
                                      keepalive_s=settings.keepalive_interval_s, started=started)
    finally:
        metrics.IN_FLIGHT.dec()
        metrics.REQUEST_DURATION.labels("chat").observe(time.monotonic() - started)


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[GATEWAY].live_models()
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "tokenbus",
             "max_model_len": info.get("max_model_len")} for name, info in sorted(models.items())]
    return web.Response(body=encode({"object": "list", "data": data}), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready when Redis answers and at least one worker is alive."""
    try:
        await request.app[REDIS].ping()
        models = await request.app[GATEWAY].live_models()
    except RedisError as exc:
        return web.json_response({"status": "unavailable", "reason": f"redis: {exc}"}, status=503)
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
    app.cleanup_ctx.append(_bus)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", prometheus)
    return app


async def _bus(app: web.Application) -> AsyncIterator[None]:
    """Opens the edge's fixed set of Redis connections and runs its event relay."""
    settings = app[SETTINGS]
    edge_id = uuid.uuid4().hex[:12]
    name = f"tokenbus-edge-{edge_id}"  # shows in CLIENT LIST, so operators can count an edge's connections
    commands = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_pool_size, timeout=5, client_name=name))
    reader = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=1, timeout=5, client_name=name))
    relay = EventRelay(reader, commands, keys.events_stream(edge_id))
    app[REDIS] = commands
    app[GATEWAY] = Gateway(commands, relay)
    async with running(relay):
        log.info("edge %s reads its events from %s", edge_id, relay.stream)
        yield
    await reader.aclose()
    await commands.aclose()
