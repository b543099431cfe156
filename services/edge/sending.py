"""Whole answers the edge writes itself (a JSON body, a file's bytes) rather than handing them to aiohttp: each
write has a deadline, so a client that reads nothing is dropped after --write-stall-s instead of holding its answer
(and, for an answer of a model, its concurrency slot) on the edge for as long as it keeps its connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from services.edge.sse import ClientGone


async def send(request: web.Request, chunks: AsyncIterator[bytes] | bytes, *, content_type: str, length: int,
               stall_s: float, status: int = 200) -> web.StreamResponse:
    """Writes `length` bytes (`chunks`, or one body) as the answer, each write within `stall_s`."""
    response = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    response.content_length = length
    try:
        await response.prepare(request)
        if isinstance(chunks, bytes):
            async with asyncio.timeout(stall_s):
                await response.write(chunks)
        else:
            async for chunk in chunks:
                async with asyncio.timeout(stall_s):
                    await response.write(chunk)
        await response.write_eof()
    except (TimeoutError, ConnectionError):
        if request.transport is not None:
            request.transport.abort()
        raise ClientGone() from None
    return response
