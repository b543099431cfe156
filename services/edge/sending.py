"""Whole answers the edge writes itself (a JSON body, a file's bytes) rather than handing them to aiohttp: each
write has a deadline, so a client that reads nothing is dropped after --write-stall-s instead of holding its answer
(and, for an answer of a model, its concurrency slot) on the edge for as long as it keeps its connection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from services.edge.sse import ClientGone

log = logging.getLogger(__name__)


async def send(request: web.Request, chunks: AsyncIterator[bytes] | bytes, *, content_type: str, length: int,
               stall_s: float, status: int = 200, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Writes `length` bytes (`chunks`, or one body) as the answer, each write within `stall_s`. Once the status
    is out, whatever stops the answer short (a stall, a failure reading the next chunk, fewer bytes than promised)
    closes the connection: the client sees a cut answer, never another answer written into this one."""
    response = web.StreamResponse(status=status, headers={**(headers or {}), "Content-Type": content_type})
    response.content_length = length
    try:
        await response.prepare(request)
    except ConnectionError:
        raise ClientGone() from None
    written = 0
    try:
        if isinstance(chunks, bytes):
            async with asyncio.timeout(stall_s):
                await response.write(chunks)
            written = len(chunks)
        else:
            async for chunk in chunks:
                async with asyncio.timeout(stall_s):
                    await response.write(chunk)
                written += len(chunk)
        if written != length:
            raise ConnectionError(f"{written} of {length} bytes")
        await response.write_eof()
    except Exception as exc:
        if not isinstance(exc, TimeoutError | ConnectionError):
            log.warning("an answer failed after %d of %d bytes: %s", written, length, type(exc).__name__)
        if request.transport is not None:
            request.transport.abort()
        raise ClientGone() from None
    return response
