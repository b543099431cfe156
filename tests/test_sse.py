"""The SSE writer against a real aiohttp server and client: direct chunk writes keep the stream whole."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.edge.sse import SSEWriter, data_frame


async def _serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> TestServer:
    app = web.Application()
    app.router.add_get("/", handler)
    server = TestServer(app)
    await server.start_server()
    return server


async def _read(server: TestServer, version: aiohttp.HttpVersion = aiohttp.HttpVersion11) -> bytes:
    async with aiohttp.ClientSession(version=version) as session, session.get(server.make_url("/")) as response:
        return await response.read()


async def _stream(request: web.Request) -> web.StreamResponse:
    sse = await SSEWriter.open(request)
    await sse.send([data_frame(b"1")])
    for payload in (b"2", b"", b"3"):  # a token that renders nothing must not end the response
        frames = [data_frame(payload)] if payload else []
        if sse.writable():
            sse.write_now(frames)
        else:
            await sse.send(frames)
    await sse.send([data_frame(b"4")])
    await sse.close()
    return sse.response


async def test_direct_writes_and_awaited_writes_make_one_stream() -> None:
    server = await _serve(_stream)
    try:
        assert await _read(server) == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"
    finally:
        await server.close()


async def test_http_1_0_clients_get_the_same_stream_without_chunking() -> None:
    server = await _serve(_stream)
    try:
        assert await _read(server, aiohttp.HttpVersion10) == b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n"
    finally:
        await server.close()
