"""Engine event streams: several requests' as one job's, in arrival order; a stream handed on event by event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from shared.protocol import bus


def interleaved(streams: list[AsyncIterator[bus.Output]]) -> AsyncIterator[bus.Output]:
    """The events of several streams in arrival order; one stream as it is (a generator less on every token's
    way, which at one stream is a wake of the worker each)."""
    return streams[0] if len(streams) == 1 else _merge(streams)


async def _merge(streams: list[AsyncIterator[bus.Output]]) -> AsyncIterator[bus.Output]:
    """Interleaves several event streams in arrival order."""
    queue: asyncio.Queue[bus.Output | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[bus.Output]) -> None:
        try:
            async for event in stream:
                queue.put_nowait(event)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def take_each(events: AsyncIterator[bus.Output], take: Callable[[bus.Output], None]) -> None:
    """Hands each event of a stream to `take` as it comes (an engine that yields its events, run into a `take`);
    what `take` raises ends the stream."""
    async for event in events:
        take(event)
