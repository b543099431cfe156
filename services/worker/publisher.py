"""Writes token events to each job's log and publishes them to the edges' channels, in one pipelined round trip
per step.

Every job task hands its events to `publish` without waiting; a single flusher sends whatever has
gathered since its last write. Events of one engine step arrive together, so they leave together,
and while one write is in flight the next batch gathers behind it. A job's log entry is written before
the edge's copy is published, in the same pipeline: whatever an edge has seen, the log has too, and what an
edge missed (it was not subscribed) it reads from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import bus, keys, metrics
from shared.rawpipe import Arg, PipelineLike, Pipelines

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.2
WRITE_TIMEOUT_S = 5.0


class AckFollowup(Protocol):
    """Commands that go in the same write as, and after, a batch's acknowledgements (the scheduler's settlement
    of the jobs that ended, and a dispatch into the slots they freed)."""

    def queue(self, pipe: PipelineLike, notes: list[Any]) -> None:
        """Adds its commands; `notes` are those given to ack_after."""

    def done(self, results: list[Any]) -> None:
        """Their results, failures included: a failure here is reported, never retried with the events."""


@dataclass
class _Batch:
    live: dict[str, list[bus.Event]] = field(default_factory=dict)
    logs: dict[str, list[bus.Event]] = field(default_factory=dict)
    expiries: dict[str, int] = field(default_factory=dict)
    acks: list[tuple[str, str, bytes]] = field(default_factory=list)
    notes: list[Any] = field(default_factory=list)
    followups: list[tuple[list[tuple[Arg, ...]], Callable[[list[Any]], None]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.live or self.acks or self.followups)


class EventPublisher:
    """Batches events per edge channel and per job log; acknowledges jobs after their last event is written."""

    def __init__(self, redis: aioredis.Redis, log_max_events: int, after_acks: AckFollowup | None = None) -> None:
        self.redis = redis
        self.pipelines = Pipelines(redis)
        self.log_max_events = log_max_events
        self.after_acks = after_acks
        self.batch = _Batch()
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()

    def publish(self, reply_to: str, event: bus.Event, log_ttl_ms: int = 0) -> None:
        """Queues an event (stamped already) for its edge and its job's log; `log_ttl_ms` sets the log's expiry."""
        self.batch.live.setdefault(reply_to, []).append(event)
        self.batch.logs.setdefault(event.job, []).append(event)
        if log_ttl_ms:
            self.batch.expiries[event.job] = log_ttl_ms
        self._wake()

    def ack_after(self, stream: str, group: str, entry_id: bytes, note: Any = None) -> None:
        """Acknowledges a job entry in the same write as (and after) its events published so far; `note` (if
        not None) goes to the write's AckFollowup."""
        self.batch.acks.append((stream, group, entry_id))
        if note is not None:
            self.batch.notes.append(note)
        self._wake()

    def then(self, commands: list[tuple[Arg, ...]], on_replies: Callable[[list[Any]], None]) -> None:
        """Sends commands in the next write, after the events and acknowledgements published so far: a lookup or
        a settlement rides a write that goes anyway instead of making a round trip of its own. Their replies (an
        error reply as the exception in its place, never retried with the events) go to `on_replies`, together,
        once the write succeeded."""
        self.batch.followups.append((commands, on_replies))
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
        batch, self.batch = self.batch, _Batch()
        if batch:
            await self._write(batch)
        if not self.batch:
            self.idle.set()

    def _pipeline(self, batch: _Batch) -> PipelineLike:
        pipe = self.pipelines.pipeline()
        for job_id, events in batch.logs.items():
            pipe.execute_command("XADD", keys.job_log(job_id), "MAXLEN", "~", self.log_max_events, "*",
                                 bus.EVENTS_FIELD, bus.encode_events(events))
            if ttl_ms := batch.expiries.get(job_id):
                pipe.execute_command("PEXPIRE", keys.job_log(job_id), ttl_ms)
        for channel, events in batch.live.items():
            pipe.execute_command("SPUBLISH", channel, bus.encode_events(events))
        for stream, group, entry_id in batch.acks:
            pipe.execute_command("XACK", stream, group, entry_id)
            pipe.execute_command("XDEL", stream, entry_id)
        return pipe

    async def _write(self, batch: _Batch) -> None:
        while True:
            pipe = self._pipeline(batch)
            essential = len(pipe)
            if batch.acks and self.after_acks is not None:
                self.after_acks.queue(pipe, batch.notes)
            acked = len(pipe)
            for commands, _on_replies in batch.followups:
                for command in commands:
                    pipe.execute_command(*command)
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):  # its connection has no socket timeout of its own
                    results = await pipe.execute(raise_on_error=False)
                if failure := next((r for r in results[:essential] if isinstance(r, Exception)), None):
                    raise failure
                break
            except (RedisError, OSError, TimeoutError) as exc:  # keep the events: a short outage must not lose them
                log.warning("writing %d event batches failed (%s); retrying", len(batch.live), exc)
                await asyncio.sleep(RETRY_PAUSE_S)
        if self.after_acks is not None and acked > essential:
            self.after_acks.done(results[essential:acked])
        at = acked
        for commands, on_replies in batch.followups:
            on_replies(results[at:at + len(commands)])
            at += len(commands)
        metrics.EVENT_FLUSHES.inc()
        metrics.EVENTS_PUBLISHED.inc(sum(map(len, batch.live.values())))

    async def drain(self, timeout_s: float) -> None:
        """Waits until everything published so far is written, at most `timeout_s`."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("unwritten events left after %.1f s", timeout_s)
