"""The one server-sent-events writer: headers, frames, keep-alives, client-gone detection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from aiohttp import HttpVersion11, web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-like proxies not to buffer the stream
}


def wants_ids(request: web.Request) -> bool:
    """Whether a stream's events carry an `id:` (what a resume starts after): for clients that say they speak
    server-sent events (`Accept: text/event-stream`, as EventSource, httpx-sse and sseclient send) or resume
    (`Last-Event-ID`). Others get the bare `data:` frames OpenAI, vLLM and TGI send: clients that parse
    those by hand (vLLM's `vllm bench serve` among them) take a frame with an `id:` line for broken JSON."""
    headers = request.headers
    return "text/event-stream" in headers.get("Accept", "") or "Last-Event-ID" in headers


def data_frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def event_frame(name: str, payload: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


DONE = data_frame(b"[DONE]")
KEEPALIVE = b": keep-alive\n"
"""A comment line alone, with no blank line after it: a blank line would end an event, and clients that
remember the last event id (the openai SDK) then hand their caller an event with empty data."""


SEND_BUFFER_BYTES = 128 * 1024
"""The kernel's send buffer of a connection that answers a model's request: a token stream needs little, and
without a bound the kernel's autotuning hides a stalled client behind megabytes before the edge can notice it (see
JobEvents.max_buffered and --max-tenant-behind-bytes); a whole answer still leaves at this buffer per round trip
(~2.5 MB/s to a client 100 ms away)."""


def bound_send_buffer(request: web.Request) -> None:
    """Bounds the send buffer of a connection that answers a model's request (see SEND_BUFFER_BYTES), once per
    connection; done while its request waits for its first event, off the first token's way."""
    connection = request.protocol
    if getattr(connection, "send_buffer_bounded", False):  # an earlier stream on this keep-alive connection
        return
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None  # costly on uvloop: a new object
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            with contextlib.suppress(AttributeError):  # a connection class without the mark
                connection.send_buffer_bounded = True  # type: ignore[attr-defined]


def unsent(transport: asyncio.Transport | None) -> int:
    """Bytes written to a connection that its client has not taken yet, beyond what the kernel holds for it."""
    return 0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()


def drop(transport: asyncio.Transport | None) -> None:
    """Closes a connection under a client that cannot keep up: its pending write fails."""
    if transport is not None:
        transport.abort()


class _EventStream(web.StreamResponse):
    """A stream response whose headers leave with its first frame, in one write: the client wakes once for
    both (aiohttp's plain Response defers its headers the same way)."""

    _send_headers_immediately = False


class ClientGone(Exception):
    """The client closed its connection before the stream ended."""


class SSEWriter:
    """Writes whole frames to one response; any failed write becomes ClientGone.

    Two ways to write: `send` awaits (it waits out a slow client), `write_now` does not and is only
    allowed while `writable()`: the event relay uses it to put token chunks straight on the socket.
    """

    def __init__(self, response: web.StreamResponse, transport: asyncio.Transport | None,
                 stall_s: float = 60.0) -> None:
        self.response = response
        self.stall_s = stall_s
        """How long one write may wait for the client to read before the connection is dropped."""
        self.connection = transport
        self.transport = transport if response.chunked else None
        """Set when chunks may be framed and written here directly (HTTP/1.1 chunked encoding)."""
        self.last_write = time.monotonic()
        self.headers_sent = False
        """Whether a write went out through the response (with the headers): `write_now` must wait for it."""

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str] | None = None,
                   stall_s: float = 60.0) -> SSEWriter:
        response = _EventStream(status=200, headers={**SSE_HEADERS, **(headers or {})})
        if request.version >= HttpVersion11:
            response.enable_chunked_encoding()
        else:
            response.force_close()  # HTTP/1.0 has no chunks: the stream ends when the connection closes
        try:
            await response.prepare(request)  # the headers go with the first write
        except ConnectionError as exc:
            raise ClientGone from exc
        return cls(response, request.transport, stall_s)

    def writable(self) -> bool:
        """True when `write_now` can hand bytes to the kernel without queueing behind earlier ones."""
        transport = self.transport
        return (transport is not None and self.headers_sent and not transport.is_closing()
                and not transport.get_write_buffer_size())

    def write_now(self, frames: list[bytes]) -> None:
        """Writes frames as one HTTP chunk without waiting; only call it while `writable()`."""
        assert self.transport is not None  # nosec B101: an invariant (tokenbus never runs with -O)
        data = b"".join(frames)
        if data:  # an empty chunk would end the response
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            self.last_write = time.monotonic()

    def unsent(self) -> int:
        return unsent(self.connection)

    def drop(self) -> None:
        """Closes the connection under a client that cannot keep up: its pending write fails as ClientGone."""
        drop(self.connection)

    def quiet_for(self, seconds: float) -> bool:
        """True when nothing was written for `seconds` (a keep-alive is due)."""
        return time.monotonic() - self.last_write >= seconds

    async def _write(self, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.stall_s):  # a client that reads nothing is dropped, not waited for
                await self.response.write(data)
        except TimeoutError as exc:
            self.drop()
            raise ClientGone from exc
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
            raise ClientGone from exc
        self.headers_sent = True
        self.last_write = time.monotonic()

    async def send(self, frames: list[bytes]) -> None:
        """Sends whole frames (made by `data_frame` / `event_frame`) in one write."""
        if frames:
            await self._write(b"".join(frames))

    async def keepalive(self) -> None:
        await self._write(KEEPALIVE)

    async def close(self) -> None:
        try:
            async with asyncio.timeout(self.stall_s):
                await self.response.write_eof()
        except TimeoutError:
            self.drop()
        except ConnectionError:
            pass

    @staticmethod
    def client_gone(request: web.Request) -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()
