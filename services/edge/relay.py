"""The edge's one reader of its events stream: fans token events out to the requests waiting for them.

However many streams are in flight, an edge process blocks on a single XREAD of its own stream, so
its Redis connection count stays fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import bus
from shared.errors import RequestTimeout, TokenbusError, from_kind

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
READ_COUNT = 512
READ_GRACE_S = 5.0
"""How much longer than its BLOCK an XREAD may take before its connection counts as lost."""
TICK_S = 0.25
"""How often a quiet request wakes to look at its deadline and its client."""
STREAM_TTL_S = 120
"""An events stream outlives its edge by this much, then Redis drops it."""


Sink = Callable[[bus.Event], bool]
"""Takes an event on the spot (True), or leaves it to the waiting request (False)."""


class JobEvents:
    """The events of one job, in order; iterating ends after the Final event, an Error raises.

    Waiting costs one future per event: no timer per wait. The relay's ticker wakes a waiter a few times a
    second instead when it has something to look at: its deadline, its client, a keep-alive (see `watch`).

    A streaming request installs a `sink` once its stream is open: while the request waits with nothing
    queued, the relay hands each event to the sink, which writes token chunks straight to the client's
    socket. That saves a task switch per token; whatever the sink declines (the end of the stream, errors,
    tokens for a client that is behind) queues for the request as before, so order is kept.
    """

    def __init__(self, job_id: str, deadline: float) -> None:
        self.job_id = job_id
        self.deadline = deadline
        self.buffer: deque[bus.Event] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Sink | None = None
        self.watch: Callable[[], bool] | None = None
        """Whether the waiting request has something to do without an event (its client left, a keep-alive is
        due), for the ticker to wake only those; None: woken on every tick."""
        self.finished = False
        self.failure: TokenbusError | None = None
        """An Error event met by `ready`, raised by the next `next` so that earlier events go out first."""

    def put(self, event: bus.Event) -> None:
        # only while the request waits with nothing queued: everything before this event is written
        if self.sink is not None and self.waiter is not None and not self.buffer:
            try:
                if self.sink(event):
                    return
            except Exception:  # a broken sink must not take the relay down: the request renders it instead
                log.exception("writing an event of job %s directly failed", self.job_id)
                self.sink = None
        self.buffer.append(event)
        self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> bus.Output | None:
        """The next event, or None when woken by a tick without one (the caller may send a keep-alive)."""
        if self.failure is not None:
            raise self.failure
        if not self.buffer:
            if time.monotonic() >= self.deadline:
                raise RequestTimeout("The request did not finish before its deadline.")
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
            if not self.buffer:
                return None
        return self._take(self.buffer.popleft())

    def ready(self) -> list[bus.Output]:
        """Every event already here, without waiting (stops after a Final; an Error waits for `next`)."""
        out: list[bus.Output] = []
        while not self.finished and self.buffer:
            try:
                event = self._take(self.buffer.popleft())
            except TokenbusError as exc:
                self.failure = exc
                break
            if event is not None:
                out.append(event)
        return out

    def _take(self, event: bus.Event) -> bus.Output | None:
        if isinstance(event, bus.Error):
            self.finished = True
            raise from_kind(event.kind, event.message, event.param, event.code)
        if isinstance(event, bus.Final):
            self.finished = True
        return event


class EventRelay:
    """Reads the edge's events stream and routes each event to its job's queue."""

    def __init__(self, reader: aioredis.Redis, commands: aioredis.Redis, stream: str) -> None:
        self.reader = reader
        """A connection of its own: it spends its life blocked in XREAD."""
        self.commands = commands
        self.stream = stream
        self.connection: Any = None
        self.jobs: dict[str, JobEvents] = {}
        self.last_id = "0-0"

    def register(self, job_id: str, deadline: float) -> JobEvents:
        events = JobEvents(job_id, deadline)
        self.jobs[job_id] = events
        return events

    def unregister(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def dispatch(self, payload: bytes) -> None:
        try:
            events = bus.decode_events(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("skipping an undecodable event batch on %s: %s", self.stream, exc)
            return
        for event in events:
            waiting = self.jobs.get(event.job)
            if waiting is not None:  # a job whose client left: nobody waits, drop it
                waiting.put(event)

    async def run(self) -> None:
        """Reads until cancelled; Redis outages are retried with a short pause."""
        while True:
            try:
                reply = await self._read()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("reading %s failed (%s); retrying", self.stream, type(exc).__name__)
                await self._drop_connection()
                await asyncio.sleep(0.5)
                continue
            except Exception:  # never die quietly: every waiting request would hang until its deadline
                log.exception("reading %s failed", self.stream)
                await self._drop_connection()
                await asyncio.sleep(0.5)
                continue
            # RESP3 answers {stream: entries}, RESP2 [[stream, entries]]; entries are [id, [field, payload]]
            for _stream, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    self.dispatch(fields[1])

    async def _read(self) -> Any:
        """One XREAD on the reader's own connection, held for good: redis-py's per-call argument checks
        and pool checkout cost a fifth of the edge's CPU in a profile. Its deadline is an asyncio.timeout
        here, not the connection's socket timeout, which costs redis-py a task per command."""
        if self.connection is None:
            self.connection = await self.reader.connection_pool.get_connection()
        async with asyncio.timeout(READ_BLOCK_MS / 1000 + READ_GRACE_S):
            await self.connection.send_command(
                "XREAD", "COUNT", READ_COUNT, "BLOCK", READ_BLOCK_MS, "STREAMS", self.stream, self.last_id,
                check_health=False,
            )
            return await self.connection.read_response()

    async def _drop_connection(self) -> None:
        if self.connection is not None:
            await self.connection.disconnect()
            await self.reader.connection_pool.release(self.connection)
            self.connection = None

    async def tick(self) -> None:
        """Wakes the waiting requests that have something to do a few times a second: a passed deadline, a
        client gone, a keep-alive due. A request whose tokens flow is left alone."""
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            for events in list(self.jobs.values()):
                if events.waiter is not None and (now >= events.deadline or events.watch is None or events.watch()):
                    events.wake()

    async def housekeep(self, interval_s: float = 5.0) -> None:
        """Trims what was read and keeps the stream alive while the edge lives."""
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
                pipe = self.commands.pipeline(transaction=False)
                pipe.xtrim(self.stream, minid=self.last_id, approximate=True)
                pipe.expire(self.stream, STREAM_TTL_S)
                await pipe.execute()


@contextlib.asynccontextmanager
async def running(relay: EventRelay) -> AsyncIterator[None]:
    """Runs the relay's reader and housekeeping for the lifetime of the block."""
    tasks = [
        asyncio.create_task(relay.run(), name="event-relay"),
        asyncio.create_task(relay.housekeep(), name="event-housekeeping"),
        asyncio.create_task(relay.tick(), name="event-ticker"),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
