"""Moves one job's events from the bus to the client: as SSE frames, or as one JSON body."""

from __future__ import annotations

import time

from aiohttp import web

from services.edge.formats.base import Renderer
from services.edge.relay import JobEvents
from services.edge.sse import ClientGone, SSEWriter
from shared import bus, metrics
from shared.errors import EngineError, TokenbusError


async def respond(
    request: web.Request, events: JobEvents, renderer: Renderer, *, stream: bool, route: str,
    keepalive_s: float, started: float,
) -> web.StreamResponse:
    """Waits for the first event before committing to a status: errors before it are plain 4xx/5xx.

    A client that goes away raises ClientGone, which the caller turns into a cancel of the job.
    """
    first = await _next(request, events)
    if first is None:
        raise EngineError("The worker ended the job without a result.")
    metrics.TIME_TO_FIRST_TOKEN.labels(route).observe(time.monotonic() - started)
    if not stream:
        event: bus.Output | None = first
        while event is not None:
            await _render(renderer, event)
            event = await _next(request, events)
        return web.Response(body=renderer.body(), content_type="application/json")
    sse = await SSEWriter.open(request)
    try:
        await _stream(request, sse, events, renderer, first, keepalive_s)
    except TokenbusError as exc:
        await sse.send(renderer.error(exc))
    await sse.close()
    return sse.response


async def _render(renderer: Renderer, event: bus.Output) -> list[bytes]:
    frames = renderer.frames(event)
    if isinstance(event, bus.Tokens):
        metrics.STREAMED_TOKENS.inc(len(event.token_ids))
    elif isinstance(event, bus.Final):
        await renderer.settle()
    return frames


async def _next(request: web.Request, events: JobEvents, idle_s: float | None = None) -> bus.Output | None:
    """The next event; None once the job's Final was seen, or after `idle_s` without one."""
    idle_since = time.monotonic()
    while not events.finished:
        if SSEWriter.client_gone(request):
            raise ClientGone
        event = await events.next()
        if event is not None:
            return event
        if idle_s is not None and time.monotonic() - idle_since >= idle_s:
            return None
    return None


async def _stream(
    request: web.Request, sse: SSEWriter, events: JobEvents, renderer: Renderer, first: bus.Output,
    keepalive_s: float,
) -> None:
    event: bus.Output | None = first
    while event is not None:
        frames = await _render(renderer, event)
        for more in events.ready():  # whatever else has arrived goes out in the same write
            frames += await _render(renderer, more)
        await sse.send(frames)
        event = await _next(request, events, idle_s=keepalive_s)
        while event is None and not events.finished:
            await sse.keepalive()
            event = await _next(request, events, idle_s=keepalive_s)
    await sse.send(renderer.done())
