"""Writes token events to the edges' streams in one pipelined round trip per engine step.

Every job task hands its events to `publish` without waiting; a single flusher sends whatever has
gathered since its last write. Events of one engine step arrive together, so they leave together,
and while one write is in flight the next batch gathers behind it.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import bus, metrics

log = logging.getLogger(__name__)

STREAM_MAXLEN = 100_000
"""Bounds an events stream whose edge died without trimming it (it also expires)."""
RETRY_PAUSE_S = 0.2
WRITE_TIMEOUT_S = 5.0


class EventPublisher:
    """Batches events per edge stream and acknowledges jobs after their last event is written."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.pending: dict[str, list[bus.Event]] = {}
        self.acks: list[tuple[str, str, bytes]] = []
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()

    def publish(self, stream: str, event: bus.Event) -> None:
        self.pending.setdefault(stream, []).append(event)
        self._wake()

    def ack_after(self, stream: str, group: str, entry_id: bytes) -> None:
        """Acknowledges a job entry in the same write as (and after) its events published so far."""
        self.acks.append((stream, group, entry_id))
        self._wake()

    def _wake(self) -> None:
        self.idle.clear()
        self.wakeup.set()

    async def run(self) -> None:
        """Flushes until cancelled."""
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            await self.flush()

    async def flush(self) -> None:
        pending, acks = self.pending, self.acks
        self.pending, self.acks = {}, []
        if pending or acks:
            await self._write(pending, acks)
        if not self.pending and not self.acks:
            self.idle.set()

    async def _write(self, pending: dict[str, list[bus.Event]], acks: list[tuple[str, str, bytes]]) -> None:
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for stream, events in pending.items():
                pipe.xadd(stream, {bus.EVENTS_FIELD: bus.encode_events(events)}, maxlen=STREAM_MAXLEN,
                          approximate=True)
            for stream, group, entry_id in acks:
                pipe.xack(stream, group, entry_id)
                pipe.xdel(stream, entry_id)
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):  # its connection has no socket timeout of its own
                    await pipe.execute()
                break
            except (RedisError, TimeoutError) as exc:  # keep the events: a short Redis outage must not lose them
                log.warning("writing %d event batches failed (%s); retrying", len(pending), exc)
                await asyncio.sleep(RETRY_PAUSE_S)
        metrics.EVENT_FLUSHES.inc()
        metrics.EVENTS_PUBLISHED.inc(sum(map(len, pending.values())))

    async def drain(self, timeout_s: float) -> None:
        """Waits until everything published so far is written, at most `timeout_s`."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("unwritten events left after %.1f s", timeout_s)
