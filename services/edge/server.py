"""Serves the edge app over aiohttp with bounded reads and parser errors in the API's error shape.

aiohttp puts no deadline on reading a request: a client that sends half a request line, or a body, one
byte a second holds its connection (and a handler) until the keep-alive runs out, or for good. Here a
request's head must arrive within `read_timeout_s` of its first byte, and its body within
`read_timeout_s` of its head: a late head drops the connection, a late body is answered with a 400 and
the connection closed. What aiohttp's parser refuses (an oversized header or request line, a garbled
request) it answers in plain text; here in the OpenAI error shape: 431, 414 or 400.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import time
from typing import Any, Protocol

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from services.edge.formats.base import openai_error
from services.edge.sse import ClientGone
from services.edge.state import DRAINING
from shared.protocol.errors import InvalidRequest, TokenbusError
from shared.runtime import exposition, gcheap, metrics, stopping
from shared.runtime.exposition import MetricsSettings

log = logging.getLogger(__name__)


class ServerSettings(MetricsSettings, Protocol):
    """The settings the server reads, its metrics endpoint's included (Settings has them)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def read_timeout_s(self) -> float: ...


MAX_REQUEST_LINE_BYTES = 8190
"""aiohttp's default; a longer request line (a longer URL) is a 414."""
MAX_HEADER_FIELD_BYTES = 16384
"""One header, name and value (room for long tokens and cookies); longer is a 431. It differs from the
line limit on purpose: the parser's error names only the limit it hit."""
MAX_HEADERS = 128
"""aiohttp's default; more headers is a 431."""
KEEPALIVE_TIMEOUT_S = 75.0
"""How long an idle connection stays open between requests (web.run_app's default)."""
RESERVED_FILES = 256
"""Open files an edge keeps for itself (its Redis connections, its metrics endpoint, its logs): once its client
connections pass its open-files limit less these, each new one closes the oldest idle ones (a keep-alive between
requests, or a head still on its way). A client that opens connections and sends nothing costs an edge no CPU and
~5 kB each, but it took every file descriptor within seconds (20,000 in 3 s, no key needed) and every other
client's connection was refused until they timed out."""
SHED_FRACTION = 16
"""Past the bound, 1/SHED_FRACTION of it is closed at once: a flood's every new connection does not scan them."""


async def read_body(request: web.Request) -> bytes:
    """The request's whole body; a body that cannot be read is the client's doing: a 400 when it came too
    late or in a broken encoding, ClientGone when the client left before sending all of it."""
    try:
        return await request.read()
    except web.RequestPayloadError:
        raise InvalidRequest("The request body could not be read: its chunked or content encoding is broken.",
                             code="bad_body_encoding") from None
    except ConnectionResetError:
        raise ClientGone() from None


def parser_error(exc: HttpProcessingError) -> tuple[int, InvalidRequest]:
    """The status and error for a request aiohttp's parser refused; the offending bytes are not echoed."""
    if isinstance(exc, LineTooLong):
        if exc.args[1] == MAX_HEADER_FIELD_BYTES:
            return 431, InvalidRequest(f"A request header is longer than {MAX_HEADER_FIELD_BYTES} bytes.",
                                       code="header_too_large")
        return 414, InvalidRequest(f"The request line is longer than {MAX_REQUEST_LINE_BYTES} bytes.",
                                   code="request_line_too_long")
    if exc.message.startswith("Too many headers"):
        return 431, InvalidRequest(f"A request may carry at most {MAX_HEADERS} headers.", code="too_many_headers")
    return 400, InvalidRequest(f"The request is not valid HTTP/1.1 ({type(exc).__name__}).", code="bad_http")


class _Connection(RequestHandler):
    """aiohttp's connection protocol with deadlines on each request's head and body."""

    def __init__(self, manager: Server, *, read_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.read_timeout_s = read_timeout_s
        self.clock = asyncio.get_running_loop()
        self.head_timer: asyncio.TimerHandle | None = None
        self.handling = False
        """From the parsed head until the response is written: bytes that arrive then are the body."""
        self.body: StreamReader | None = None
        """The body of the request being handled."""
        self.send_buffer_bounded = False
        """Set by the first stream on this connection (services.edge.sse.bound_send_buffer)."""

    def data_received(self, data: bytes) -> None:
        if self.head_timer is None and not self.handling:  # the first bytes of a request start its clock
            self.head_timer = self.clock.call_later(self.read_timeout_s, self._head_late)
        closing = self._close, self._force_close
        if any(closing) and self.body is not None and not self.body.is_eof():
            # a drain began while this request's body was on its way: aiohttp drops whatever arrives once it
            # closes, and the request would wait out its body deadline for a 400; the body is still taken
            self._close = self._force_close = False
            try:
                super().data_received(data)
            finally:
                self._close, self._force_close = closing
            return
        super().data_received(data)

    def request_started(self, payload: StreamReader) -> None:
        """The head is parsed: its clock stops and the body's starts."""
        self.handling, self.body = True, payload
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if not payload.is_eof():
            timer = self.clock.call_later(self.read_timeout_s, self._body_late, payload)
            payload.on_eof(timer.cancel)

    def _head_late(self) -> None:
        self.head_timer = None
        if not self.handling:
            log.debug("dropped a connection that took over %g s to send a request head", self.read_timeout_s)
            self.force_close()

    def _body_late(self, payload: StreamReader) -> None:
        # the handler reading the body gets the error and answers it in its route's shape
        payload.set_exception(InvalidRequest(
            f"The request body did not arrive within {self.read_timeout_s:g} s.", code="body_timeout"))

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.handling, self.body = False, None
            if request.content.exception() is not None:
                # the rest of a late or broken body is not worth waiting for (aiohttp would linger on it)
                self.force_close()

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's own answers (what its parser refused, a failure past the app's middleware) in the
        OpenAI error shape rather than plain text; the connection closes after them."""
        error: TokenbusError
        if isinstance(exc, HttpProcessingError):
            status, error = parser_error(exc)
            log.debug("refused a malformed request: %d %s", status, type(exc).__name__)
        else:
            super().handle_error(request, status, exc, message)  # logs it, and refuses once a response began
            error = TokenbusError("The server failed to handle the request.")
        metrics.REQUESTS.labels("unparsed", str(status)).inc()
        response = web.Response(status=status, body=openai_error(error), content_type="application/json")
        response.force_close()
        return response


class _Server(Server):
    """aiohttp's Server (same handler, factory and arguments) making _Connection protocols."""

    def __init__(self, plain: Server, read_timeout_s: float) -> None:
        self.make_request = plain.request_factory
        self.read_timeout_s = read_timeout_s
        # aiohttp has no hook for the connection class: the server is rebuilt with the arguments it got
        super().__init__(plain.request_handler, request_factory=self._request,
                         handler_cancellation=plain.handler_cancellation, **plain._kwargs)

    def _request(
        self, message: RawRequestMessage, payload: StreamReader, protocol: RequestHandler,
        writer: AbstractStreamWriter, task: asyncio.Task[None],
    ) -> BaseRequest:
        if isinstance(protocol, _Connection):
            protocol.request_started(payload)
        return self.make_request(message, payload, protocol, writer, task)

    def __call__(self) -> RequestHandler:
        return _Connection(self, read_timeout_s=self.read_timeout_s, loop=asyncio.get_running_loop(),
                           **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        most = most_connections()
        if most is not None and len(self._connections) > most:
            self._close_idle(len(self._connections) - most + most // SHED_FRACTION)

    def _close_idle(self, count: int) -> None:
        """Closes the `count` oldest connections with no request being handled (see RESERVED_FILES)."""
        idle = [handler for handler in self._connections if isinstance(handler, _Connection) and not handler.handling]
        for handler in idle[:count]:
            handler.force_close()
        if idle:
            metrics.IDLE_CONNECTIONS_CLOSED.inc(min(count, len(idle)))
            log.warning("closed %d idle connections: open files ran low", min(count, len(idle)))


def most_connections() -> int | None:
    """The client connections an edge keeps open at once (its open-files limit less RESERVED_FILES; None: no
    limit). Read as each comes: an operator may change a running edge's limit (prlimit)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else max(1, soft - RESERVED_FILES)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections have read deadlines and answer parser errors in the API's shape."""

    def __init__(self, app: web.Application, *, read_timeout_s: float, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        super().__init__(app, max_line_size=MAX_REQUEST_LINE_BYTES, max_field_size=MAX_HEADER_FIELD_BYTES,
                         max_headers=MAX_HEADERS, **kwargs)
        self.read_timeout_s = read_timeout_s

    async def _make_server(self) -> Server:
        return _Server(await super()._make_server(), self.read_timeout_s)


async def serve(app: web.Application, settings: ServerSettings, *, shutdown_timeout: float) -> None:
    """Serves until SIGINT or SIGTERM, then shuts down as web.run_app does (handlers get shutdown_timeout); the
    metrics endpoint outlasts the drain."""
    async with exposition.serving(settings, metrics.EDGE, "edge"):
        await _serve_api(app, settings, shutdown_timeout)


async def _serve_api(app: web.Application, settings: ServerSettings, shutdown_timeout: float) -> None:
    runner = GuardedRunner(app, read_timeout_s=settings.read_timeout_s, access_log=None,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    stopped = 0.0
    try:
        gcheap.freeze_startup_heap()
        await web.TCPSite(runner, settings.host, settings.port).start()
        await stop.wait()
        stopped = time.monotonic()
        stopping.arm("edge", shutdown_timeout + stopping.STOP_MARGIN_S)
        # a drain: /ready turns 503, the listener closes, streams in flight get `shutdown_timeout` to end
        # (those still running then are kept by their workers for a resume on another edge)
        app[DRAINING].set()
        log.info("draining: up to %g s for the requests in flight", shutdown_timeout)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await runner.cleanup()
        if stopped:
            log.info("stopped %.1f s after the signal", time.monotonic() - stopped)
