"""The edge's one reader of its events stream: fans token events out to the requests waiting for them.

However many streams are in flight, an edge process blocks on a single XREAD of its own stream, so
its Redis connection count stays fixed. The relay also keeps the edge's heartbeat (workers keep the jobs
of a dead edge only for a resume), and it is where the edge learns that Redis is unreachable: past
`redis_down_after_s` without an answer, every waiting request ends with an error instead of waiting for its
deadline, and new requests are refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from services.edge.jobevents import JobEvents
from shared import bus, joblog, keys, metrics, rawpipe
from shared.background import looping
from shared.errors import Unavailable, WorkerLost

log = logging.getLogger(__name__)

READ_BLOCK_MS = 2000
"""An idle edge's read ends this often; each costs the edge and Redis a wake-up."""
READ_COUNT = 512
READ_GRACE_S = 2.0
"""How much longer than its BLOCK an XREAD may take before its connection counts as lost: more than a tick of
Redis's timer, which ends a BLOCK (a second at the `hz 1` tokenbus runs Redis with)."""
TICK_S = 0.25
"""How often a quiet request wakes to look at its deadline and its client."""
STREAM_TTL_S = 120
"""An events stream outlives its edge by this much, then Redis drops it."""
RETRY_PAUSE_S = 0.5


@dataclass(frozen=True)
class Timing:
    """The relay's deadlines and bounds, from the settings."""

    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 6.0
    redis_down_after_s: float = 2.0
    max_buffered_events: int = 4096

    @property
    def takeover_wait_s(self) -> float:
        """How long a job whose owner stopped beating may wait for another worker to take it over: the
        claim's idle time and two supervision rounds, with a margin."""
        return self.heartbeat_ttl_s + 2 * self.heartbeat_interval_s + 2.0


class EventRelay:
    """Reads the edge's events stream and routes each event to its job's queue."""

    def __init__(self, reader: aioredis.Redis, commands: aioredis.Redis, stream: str,
                 timing: Timing | None = None, worker_alive: Callable[[str], bool] | None = None) -> None:
        self.reader = reader
        """A connection of its own: it spends its life blocked in XREAD."""
        self.commands = commands
        self.pipelines = rawpipe.Pipelines(commands, keep=False)
        """The heartbeat's writes (the stream's trimming with them)."""
        self.stream = stream
        self.timing = timing or Timing()
        self.worker_alive = worker_alive
        self.live_edges = 1
        """Edges whose heartbeat was current at this edge's last beat (itself included)."""
        self.connection: Any = None
        self.release: Any = None
        """How a cluster node takes its connection back (None: the reader's own pool)."""
        self.jobs: dict[str, JobEvents] = {}
        self.busy = asyncio.Event()
        """Set while jobs are registered: the ticker sleeps without them."""
        self.last_id: bytes | str = "0-0"
        self.down_since: float | None = None
        """When reading from Redis began to fail; None while it answers."""

    def register(self, job_id: str, deadline: float) -> JobEvents:
        events = JobEvents(job_id, deadline, self.read_log, self.timing.max_buffered_events)
        self.jobs[job_id] = events
        self.busy.set()
        return events

    def unregister(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        if not self.jobs:
            self.busy.clear()

    async def read_log(self, job_id: str) -> list[bus.Event]:
        return await joblog.read(self.commands, job_id)

    def redis_down(self) -> bool:
        """True once Redis has not answered for the configured time (new requests are refused at once)."""
        return self.down_since is not None and time.monotonic() - self.down_since >= self.timing.redis_down_after_s

    def dispatch(self, payload: bytes) -> None:
        try:
            events = bus.decode_events(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("skipping an undecodable event batch on %s: %s", self.stream, exc)
            return
        for event in events:
            waiting = self.jobs.get(event.job)
            if waiting is not None:  # a job whose client left: nobody waits, drop it
                waiting.offer(event)

    async def run(self) -> None:
        """Reads until cancelled; Redis outages are retried with a short pause."""
        while True:
            try:
                reply = await self._read()
            except Exception as exc:  # never die quietly: every waiting request would hang until its deadline
                self._failed(exc)
                await self._drop_connection()
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if self.down_since is not None:
                log.info("reading %s again after an outage", self.stream)
                self.down_since = None
                metrics.REDIS_UP.set(1)
            for entry_id, fields in rawpipe.stream_entries(reply):  # fields: [field, payload]
                self.last_id = entry_id
                self.dispatch(fields[1])

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, RedisError | OSError | TimeoutError):
            log.warning("reading %s failed (%s); retrying", self.stream, type(exc).__name__)
        else:
            log.exception("reading %s failed", self.stream)
        if self.down_since is None:
            self.down_since = time.monotonic()
            metrics.REDIS_UP.set(0)

    async def _read(self) -> Any:
        """One XREAD on the reader's own connection, held for good: redis-py's per-call argument checks
        and pool checkout cost a fifth of the edge's CPU in a profile; hiredis packs the command, in C.
        Its deadline is an asyncio.timeout
        here, not the connection's socket timeout, which costs redis-py a task per command."""
        async with asyncio.timeout(READ_BLOCK_MS / 1000 + READ_GRACE_S):
            if self.connection is None:
                self.connection = await self._take_connection()
            await self.connection.send_packed_command(rawpipe.pack(
                ("XREAD", "COUNT", READ_COUNT, "BLOCK", READ_BLOCK_MS, "STREAMS", self.stream, self.last_id)),
                check_health=False)
            return await self.connection.read_response()

    async def _take_connection(self) -> Any:
        """A connection of the reader's pool; on a cluster, of the node that holds this edge's stream."""
        if isinstance(self.reader, RedisCluster):
            await self.reader.initialize()
            node = self.reader.get_node_from_key(self.stream)
            connection = node.acquire_connection()
            await connection.connect()
            self.release = node.release
            return connection
        return await self.reader.connection_pool.get_connection()

    async def _drop_connection(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                await self.connection.disconnect()
            if self.release is not None:
                self.release(self.connection)
            else:
                await self.reader.connection_pool.release(self.connection)
            self.connection = None

    async def tick(self) -> None:
        """Wakes the waiting requests that have something to do a few times a second: a passed deadline, a
        client gone, a keep-alive due, an owner that died, a Redis outage. A request whose tokens flow is
        left alone."""
        while True:
            await self.busy.wait()  # an idle edge has nothing to wake
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            outage = self.redis_down()
            for events in list(self.jobs.values()):
                if outage:
                    events.fail(Unavailable("The service lost its connection to the queue; try again."))
                else:
                    self._watch_owner(events, now)
                if events.waiter is not None and (now >= events.deadline or events.watch is None or events.watch()):
                    events.wake()

    def _watch_owner(self, events: JobEvents, now: float) -> None:
        """A job whose owner stopped beating is given time for another worker to take it over, then fails."""
        if self.worker_alive is None or not events.owner or self.worker_alive(events.owner):
            events.owner_lost_since = None
            return
        if events.owner_lost_since is None:
            events.owner_lost_since = now
        elif now - events.owner_lost_since > self.timing.takeover_wait_s and not events.failing:
            metrics.WORKERS_LOST.inc()
            events.fail(WorkerLost("The worker running this request died and no other worker took it over."))

    async def heartbeat(self) -> None:
        """Tells workers this edge still reads its stream, learns how many edges are alive, and trims what was
        read from its stream (which it keeps alive while the edge lives): one round trip a beat."""
        ttl_ms = int(self.timing.heartbeat_ttl_s * 1000)
        while True:
            now = time.time()
            with contextlib.suppress(RedisError, OSError):
                pipe = self.pipelines.pipeline()
                pipe.execute_command("XTRIM", self.stream, "MINID", "~", self.last_id)
                pipe.execute_command("EXPIRE", self.stream, STREAM_TTL_S)
                pipe.execute_command("SET", keys.edges_alive(self.stream), 1, "PX", ttl_ms)
                pipe.execute_command("ZADD", keys.EDGES, now + self.timing.heartbeat_ttl_s, self.stream)
                pipe.execute_command("ZREMRANGEBYSCORE", keys.EDGES, "-inf", now)
                pipe.execute_command("ZCARD", keys.EDGES)
                self.live_edges = max(1, int((await pipe.execute())[-1]))
            await asyncio.sleep(self.timing.heartbeat_interval_s)

    async def say_goodbye(self) -> None:
        """Workers keep this edge's remaining jobs for a resume elsewhere from now on."""
        with contextlib.suppress(RedisError, OSError):
            pipe = self.commands.pipeline(transaction=False)
            pipe.delete(keys.edges_alive(self.stream))
            pipe.zrem(keys.EDGES, self.stream)
            await pipe.execute()


@contextlib.asynccontextmanager
async def running(relay: EventRelay) -> AsyncIterator[None]:
    """Runs the relay's reader, ticker and heartbeat for the lifetime of the block."""
    metrics.REDIS_UP.set(1)
    try:
        async with looping(event_relay=relay.run(), event_ticker=relay.tick(), edge_heartbeat=relay.heartbeat()):
            yield
    finally:
        await relay.say_goodbye()
