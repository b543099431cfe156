"""The edge application: `create_app(settings)` wires Redis, the event relay and the routes."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from services.edge import background, batch_driver, keyless, routes, sending
from services.edge.admission import Admitter, renewing
from services.edge.auth import ANONYMOUS, CALLER, KeyCache, listening
from services.edge.batch_store import BatchStore
from services.edge.call_gate import CallGate
from services.edge.conversation_store import ConversationStore
from services.edge.directory import ModelDirectory
from services.edge.file_store import FileStore
from services.edge.formats import messages_render, tgi
from services.edge.formats.base import MAX_MESSAGES, encode, openai_error
from services.edge.gateway import Gateway
from services.edge.ops import expected_models
from services.edge.redis_boundary import REDIS_FAILURES, unavailable
from services.edge.relay import EventRelay, Timing, running
from services.edge.routes import Route, route_of
from services.edge.schema_checks import Checker
from services.edge.sse import ClientGone
from services.edge.state import (
    ADMITTER,
    BATCHES,
    CALL_GATE,
    CHECKER,
    CONVERSATIONS,
    DRAINING,
    FILES,
    GATEWAY,
    KEYS,
    RATE_HEADERS,
    REDIS,
    REQUEST_ID,
    SETTINGS,
    STORE,
)
from services.edge.store import ResponseStore, watching
from shared.protocol import keys
from shared.protocol.errors import MethodNotAllowed, NotFound, PayloadTooLarge, RateLimited, TokenbusError
from shared.redisio import clients as redis_clients
from shared.runtime import beats, logs, metrics
from shared.runtime.background import looping
from shared.runtime.settings import Settings
from shared.tenancy import fairshare
from shared.tenancy.limits import Limits, Settlements

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


RETRY_AFTER_S = 1
"""What a 503 or 429 tells a client to wait before trying again, unless its error knows better (a rate limit
says how long it needs, a full queue how long it takes to drain)."""


def _error_response(route: Route, error: TokenbusError) -> web.Response:
    metrics.REJECTIONS.labels(route.path, error.code or error.type).inc()
    if route.family == "tgi":
        status, _type = tgi.error_status(error)
        body = tgi.tgi_error(error)
    elif route.family == "anthropic":
        status, body = error.status, encode(messages_render.error_body(error))
    else:
        status, body = error.status, openai_error(error)
    headers = None
    if error.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    elif status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _http_error(request: web.Request, exc: web.HTTPException) -> TokenbusError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge(f"The request body is larger than {request.app[SETTINGS].max_body_bytes} bytes.")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
    if isinstance(exc, web.HTTPNotFound):
        return NotFound(f"No route for {request.method} {request.path}.")
    return TokenbusError(exc.reason)


def _check_ids(request: web.Request) -> None:
    """An id in a path (a file's, a conversation's, a batch's, a response's) names one of its kind: one with a `:`
    would name a key beside it in Redis (a file's chunks, a conversation's items), so none exists."""
    for name, value in request.match_info.items():
        if name.endswith("_id") and ":" in value:
            raise NotFound(f"No {name.removesuffix('_id')} with id '{value}' exists.", param=name)


async def _admit(request: web.Request, route: Route) -> None:
    """Who is calling (when the edge needs keys), and the key's limits for routes that run no model."""
    _check_ids(request)
    if route.needs_redis:
        request.app[GATEWAY].check_redis()
    settings = request.app[SETTINGS]
    if settings.auth != "keys":
        keyless.check(request, settings.host)
    if not route.needs_key or settings.auth != "keys":
        request[CALLER] = ANONYMOUS  # set, not left to a default: a missing key costs aiohttp an exception
        return
    caller = await request.app[KEYS].authenticate(request)
    request[CALLER] = caller
    if not route.runs_model:
        request.app[CALL_GATE].enter(request, caller.tenant)
        request[RATE_HEADERS] = await request.app[ADMITTER].peek(caller)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into the route's error shape; nothing leaves as an HTML page or a bare 500."""
    route = route_of(request)
    given = request.headers.get("x-request-id", "")
    request[REQUEST_ID] = given if logs.VALID_REQUEST_ID.match(given) else uuid.uuid4().hex
    logs.REQUEST_ID.set(request[REQUEST_ID])
    response: web.StreamResponse
    try:
        await _admit(request, route)
        response = await handler(request)
        response = await _written(request, response)
    except REDIS_FAILURES as exc:  # one no deeper call turned into its error (services/edge/redis_boundary.py)
        log.warning("redis failed on %s: %s", route.path, type(exc).__name__)
        response = _error_response(route, unavailable())
    except RateLimited as exc:
        request[RATE_HEADERS] = exc.headers
        response = _error_response(route, exc)
    except TokenbusError as exc:
        response = _error_response(route, exc)
    except web.HTTPException as exc:
        response = _error_response(route, _http_error(request, exc))
    except ClientGone:
        # the client will not read an answer; its job was cancelled on the way out
        metrics.CLIENT_DISCONNECTS.inc()
        response = web.Response(status=499)
    except Exception:
        log.exception("unexpected failure on %s", route.path)
        response = _error_response(route, TokenbusError("The server failed to handle the request."))
    finally:
        request.app[CALL_GATE].leave(request)
    metrics.REQUESTS.labels(route.path, str(response.status)).inc()
    return response


LARGE_ANSWER_BYTES = 64 * 1024
"""A whole answer past this (a page of a conversation's items, a list) is written by the edge within the write
deadline, and within its tenant's call gate (services.edge.sending); a smaller one fits the socket's buffers."""


async def _written(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """A large answer a handler returned whole, written here with a deadline on each write (aiohttp would wait on a
    client that reads nothing for as long as it keeps its connection, holding the answer)."""
    if not isinstance(response, web.Response) or response.prepared or not isinstance(response.body, bytes) \
            or len(response.body) <= LARGE_ANSWER_BYTES:
        return response
    extra = {name: value for name, value in response.headers.items() if name not in ("Content-Type",
                                                                                     "Content-Length")}
    return await sending.send(request, response.body, content_type=response.headers.get("Content-Type",
                                                                                     response.content_type),
                              length=len(response.body), stall_s=request.app[SETTINGS].write_stall_s,
                              status=response.status, headers=extra)


async def _answer_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The request id and the key's x-ratelimit-* headers go on every answer, before its first byte (streams
    included)."""
    if request_id := request.get(REQUEST_ID):
        response.headers["x-request-id"] = request_id
    if found := request.get(RATE_HEADERS):
        response.headers.update(found)


def create_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[DRAINING] = asyncio.Event()
    app[CALL_GATE] = CallGate(settings.max_tenant_calls_in_flight)
    background.add_to(app)
    batch_driver.add_to(app)
    app.cleanup_ctx.append(_bus)
    app.cleanup_ctx.append(_checker)
    app.on_response_prepare.append(_answer_headers)
    routes.add_to(app)
    return app


async def _checker(app: web.Application) -> AsyncIterator[None]:
    """The process that checks large schemas and every pattern off the loop: started on first use."""
    app[CHECKER] = Checker()
    yield
    await app[CHECKER].close()


async def _bus(app: web.Application) -> AsyncIterator[None]:
    """Opens the edge's fixed set of Redis connections and runs its event relay."""
    settings = app[SETTINGS]
    edge_id = uuid.uuid4().hex[:12]
    name = f"tokenbus-edge-{edge_id}"  # shows in CLIENT LIST, so operators can count an edge's connections
    access = redis_clients.access_of(settings)
    commands = redis_clients.pooled(settings.redis_url, name, settings.redis_pool_size, settings.redis_cluster,
                                    access)
    # the relay bounds each of its reads itself
    reader = redis_clients.dedicated(settings.redis_url, name, settings.redis_cluster, access)
    directory = ModelDirectory(commands, expected_models(settings), settings.heartbeat_interval_s)
    timing = Timing(heartbeat_interval_s=settings.heartbeat_interval_s, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                    redis_down_after_s=settings.redis_down_after_s, max_buffered_events=settings.max_buffered_events,
                    max_tenant_behind_bytes=settings.max_tenant_behind_bytes)
    relay = EventRelay(reader, commands, keys.events_channel(edge_id), timing, directory.alive)
    app[REDIS] = commands
    settlements = Settlements(commands)
    app[GATEWAY] = Gateway(commands, relay, directory, fairshare.for_settings(commands, settings), settlements,
                           settings.resume_window_s)
    app[STORE] = ResponseStore(commands, settings)
    app[CONVERSATIONS] = ConversationStore(commands, settings.response_ttl_s, settings.max_body_bytes, MAX_MESSAGES)
    app[FILES] = FileStore(commands, settings.response_ttl_s)
    app[BATCHES] = BatchStore(commands, settings.response_ttl_s)
    app[batch_driver.BATCH_DRIVER] = batch_driver.BatchDriver(app)
    app[KEYS] = KeyCache(commands, redis_clients.dedicated(settings.redis_url, name, settings.redis_cluster, access),
                         settings.key_cache_s, on_revoked=app[GATEWAY].revoked)
    app[ADMITTER] = Admitter(Limits(commands, settings.lease_ttl_s), settlements,
                             settings.admission_when_redis_down, lambda: relay.live_edges,
                             settings.metrics_max_tenants, settings.prompt_cache == "shared")
    if settings.auth == "none":
        log.warning("serving without API keys (--auth none): anyone who reaches this port may use every model")
    renewal_s = beats.whole_beats(settings.lease_ttl_s / 3, settings.heartbeat_interval_s)  # on the heartbeat's beats
    async with running(relay), directory.running(), listening(app[KEYS]), \
            renewing(app[ADMITTER], renewal_s), watching(app[STORE]), \
            looping(batches=app[batch_driver.BATCH_DRIVER].looking()):
        log.info("edge %s listens for its events on %s", edge_id, relay.channel)
        yield
    await reader.aclose()
    await app[KEYS].channels.aclose()
    await commands.aclose()
