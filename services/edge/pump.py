"""Moves one job's events from the bus to the client: as SSE frames, or as one JSON body."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.edge import framing, sending
from services.edge import sse as sse_module
from services.edge.formats.base import Payload, Renderer
from services.edge.jobevents import JobEvents, Sink
from services.edge.sse import ClientGone, SSEWriter, bound_send_buffer
from services.edge.store import Turn
from shared.protocol import bus
from shared.protocol.errors import EngineError, TokenbusError
from shared.runtime import metrics

log = logging.getLogger(__name__)

Keep = Callable[[Turn], Awaitable[object]]
"""Stores a finished turn a renderer reports (ResponseStore.keep, with the caller's tenant)."""


class _Delivery:
    """Renders one job's events, numbers the frames (the SSE `id:` a client resumes after, sent when `ids`) and
    counts the tokens that reached the client (once, at the end), the gaps between token events, the prompt
    tokens and the finish reasons. A resumed stream renders everything again and sends only the frames after the
    client's last id."""

    def __init__(self, renderer: Renderer, job_id: str, model: str, after: int = -1, ids: bool = True,
                 keep: Keep | None = None) -> None:
        self.renderer = renderer
        self.keep = keep
        self.model = model
        self.tokens = 0
        self.prefix = b"id: " + job_id.encode() + b":" if ids else b""
        self.numbered = 0
        self.after = after
        self.gaps = metrics.INTER_TOKEN_LATENCY.labels(model)
        self.last_tokens_at = 0.0

    def stamp(self, frames: list[bytes]) -> list[bytes]:
        """Gives each frame its id (if ids are sent); drops the frames the client already has."""
        if not self.prefix:  # a stream without ids is never a resumed one
            self.numbered += len(frames)
            return frames
        out: list[bytes] = []
        for frame in frames:
            number, self.numbered = self.numbered, self.numbered + 1
            if number > self.after:
                out.append(self.prefix + b"%d\n" % number + frame)
        return out

    def take(self, event: bus.Output) -> list[Payload]:
        """The payloads the renderer makes of the event (counted unless the client already has them)."""
        if self.numbered > self.after:  # not a replayed event the client already has
            self._count(event)
        return self.renderer.render(event)

    def frames(self, event: bus.Output) -> list[bytes]:
        return [framing.frame(payload) for payload in self.take(event)]

    def _count(self, event: bus.Output) -> None:
        if isinstance(event, bus.Tokens):
            if event.token_ids:
                self.tokens += len(event.token_ids)
                now = time.monotonic()
                if self.last_tokens_at:
                    self.gaps.observe((now - self.last_tokens_at) / len(event.token_ids))
                self.last_tokens_at = now
            if event.finish_reason is not None:
                metrics.FINISH_REASONS.labels(self.model, event.finish_reason).inc()
        elif isinstance(event, bus.Final):
            metrics.PROMPT_TOKENS.labels(self.model).inc(event.prompt_tokens)

    async def render(self, event: bus.Output, stream: bool = True) -> list[bytes]:
        """The event's frames (none for an answer that is not streamed: its body is made at the end); after the
        Final's, stores what the renderer reports."""
        if stream:
            frames = self.frames(event)
        else:
            frames = []
            self.take(event)
        if isinstance(event, bus.Final) and self.keep is not None and (turn := self.renderer.to_store()):
            await self.keep(turn)
        return frames

    def sink(self, sse: SSEWriter) -> Sink:
        """What the relay calls with each event while the request waits: token chunks go straight out."""

        def take(event: bus.Event) -> bool:
            if not isinstance(event, bus.Tokens) or not sse.writable():
                return False
            sse.write_now(self.stamp(self.frames(event)))
            return True

        return take


async def respond(
    request: web.Request, events: JobEvents, renderer: Renderer, *, stream: bool, model: str,
    keepalive_s: float, started: float, after: int = -1, tenant: tuple[str, str] | None = None,
    ids: bool = True, keep: Keep | None = None, write_stall_s: float = 60.0,
) -> web.StreamResponse:
    """Waits for the first event before committing to a status: errors before it are plain 4xx/5xx.

    A client that goes away raises ClientGone, which the caller turns into a cancel of the job (or keeps it
    for a resume). A resumed stream sends only the frames numbered after `after`; frames carry their number
    as an SSE `id:` when `ids`. `tenant` (its metrics label, the model) also counts the time to first token
    per tenant. `keep` stores what the renderer reports once the job's Final was seen, before the client hears
    of it. A client that leaves its writes unread for `write_stall_s` is dropped (ClientGone).
    """
    events.watch = functools.partial(SSEWriter.client_gone, request)
    bound_send_buffer(request)  # a whole answer too: what a client does not read is the edge's to bound
    first = await _next(request, events)
    if first is None:
        raise EngineError("The worker ended the job without a result.")
    metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(time.monotonic() - started)
    if tenant is not None:
        metrics.TENANT_TIME_TO_FIRST_TOKEN.labels(*tenant).observe(time.monotonic() - started)
    delivery = _Delivery(renderer, events.job_id, model, after, ids, keep)
    try:
        if not stream:
            event: bus.Output | None = first
            while event is not None:
                await delivery.render(event, stream=False)
                event = await _next(request, events)
            body = framing.body(renderer.body())  # written here, within the stall deadline, the job's slot held
            events.unsent = functools.partial(sse_module.unsent, request.transport)  # held as a stream's is
            events.on_overflow = functools.partial(sse_module.drop, request.transport)
            return await sending.send(request, body, content_type="application/json", length=len(body),
                                      stall_s=write_stall_s)
        sse = await SSEWriter.open(request, stall_s=write_stall_s)
        try:
            await _stream(request, sse, events, delivery, first, keepalive_s)
        except TokenbusError as exc:
            await sse.send(delivery.stamp(framing.frames(renderer.error(exc))))
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception:  # the status and headers are out: the error can only be the stream's own last event
            log.exception("a stream failed")
            await sse.send(delivery.stamp(framing.frames(renderer.error(TokenbusError(
                "The server failed to continue the stream.")))))
        await sse.close()
        return sse.response
    finally:
        events.sink = events.unsent = None
        metrics.STREAMED_TOKENS.labels(model).inc(delivery.tokens)


async def collect(events: JobEvents, renderer: Renderer, model: str, keep: Keep) -> None:
    """Follows a job no client is connected to (a background response) to its end, and stores what its renderer
    reports then, a failure's answer included."""
    delivery = _Delivery(renderer, events.job_id, model, ids=False, keep=keep)
    try:
        while not events.finished:
            if (event := await events.next()) is not None:
                await delivery.render(event, stream=False)
    except TokenbusError as exc:
        renderer.error(exc)
        if turn := renderer.to_store():
            await keep(turn)
    finally:
        metrics.STREAMED_TOKENS.labels(model).inc(delivery.tokens)


async def answer(events: JobEvents, renderer: Renderer, model: str,
                 keep: Keep | None = None) -> tuple[bytes, tuple[int, int]]:
    """The answer of a job no client waits on (a line of a batch): its JSON body, and its prompt and completion
    tokens; its failure is raised."""
    delivery = _Delivery(renderer, events.job_id, model, ids=False, keep=keep)
    usage = (0, 0)
    try:
        while not events.finished:
            if (event := await events.next()) is not None:
                await delivery.render(event, stream=False)
                if isinstance(event, bus.Final):
                    usage = (event.prompt_tokens, event.completion_tokens)
        return framing.body(renderer.body()), usage
    finally:
        metrics.STREAMED_TOKENS.labels(model).inc(delivery.tokens)


async def _next(
    request: web.Request, events: JobEvents, sse: SSEWriter | None = None, keepalive_s: float = 0.0
) -> bus.Output | None:
    """The next event; None once the job's Final was seen, or when `sse` wrote nothing for `keepalive_s`."""
    if events.failure is not None:  # an Error that came in a batch, after the events it followed
        raise events.failure
    while not events.finished:
        if SSEWriter.client_gone(request):
            raise ClientGone
        event = await events.next()
        if event is not None:
            return event
        if sse is not None and sse.quiet_for(keepalive_s):
            return None
    return None


async def _stream(
    request: web.Request, sse: SSEWriter, events: JobEvents, delivery: _Delivery, first: bus.Output,
    keepalive_s: float,
) -> None:
    events.sink = delivery.sink(sse)
    events.on_overflow = sse.drop
    events.unsent = sse.unsent
    events.watch = lambda: SSEWriter.client_gone(request) or sse.quiet_for(keepalive_s)
    event: bus.Output | None = first
    while event is not None:
        frames = await delivery.render(event)
        for more in events.ready():  # whatever else has arrived goes out in the same write
            frames += await delivery.render(more)
        await sse.send(delivery.stamp(frames))
        event = await _next(request, events, sse, keepalive_s)
        while event is None and not events.finished:
            await sse.keepalive()
            event = await _next(request, events, sse, keepalive_s)
    await sse.send(delivery.stamp(framing.frames(delivery.renderer.done())))
