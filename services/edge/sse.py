"""The one server-sent-events writer: headers, frames, keep-alives, client-gone detection."""

from __future__ import annotations

import contextlib

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # tell nginx-like proxies not to buffer the stream
}


def data_frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def event_frame(name: str, payload: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


DONE = data_frame(b"[DONE]")


class ClientGone(Exception):
    """The client closed its connection before the stream ended."""


class SSEWriter:
    """Writes `data:` frames to one response; any failed write becomes ClientGone."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str] | None = None) -> SSEWriter:
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
        try:
            await response.prepare(request)
        except ConnectionError as exc:
            raise ClientGone from exc
        return cls(response)

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
            raise ClientGone from exc

    async def send(self, frames: list[bytes]) -> None:
        """Sends whole frames (made by `data_frame` / `event_frame`) in one write."""
        if frames:
            await self._write(b"".join(frames))

    async def keepalive(self) -> None:
        await self._write(b": keep-alive\n\n")

    async def close(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.response.write_eof()

    @staticmethod
    def client_gone(request: web.Request) -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()
