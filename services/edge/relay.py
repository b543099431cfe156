"""The edge's one subscriber to its events channel: fans token events out to the requests waiting for them.

However many streams are in flight, an edge process holds a single subscription (SSUBSCRIBE to its own
channel), so its Redis connection count stays fixed. Workers write each event to its job's log first, then
publish it to the channel of the job's edge: a subscription delivers it with no read to re-arm (a stream read
by XREAD costs Redis and the edge one more wake per event), and what it missed while it was not subscribed
is read from the logs of the waiting requests once it is again.

The relay also keeps the edge's heartbeat (workers keep the jobs of a dead edge only for a resume), and it is
where the edge learns that Redis is unreachable: past `redis_down_after_s` without an answer, every waiting
request ends with an error instead of waiting for its deadline, and new requests are refused at once.
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
from redis.exceptions import ConnectionError as RedisConnectionError

from services.edge.jobevents import JobEvents
from services.edge.redis_boundary import REDIS_FAILURES, redis_boundary, unavailable
from shared.protocol import bus, joblog, keys
from shared.protocol.errors import QueueTimeout, WorkerLost
from shared.redisio import internals, rawpipe
from shared.runtime import beats, metrics
from shared.runtime.background import looping

log = logging.getLogger(__name__)

PING_AFTER_S = 2.0
"""A subscription quiet this long is asked for a PONG, on the beats of this period (shared.runtime.beats): with the
default heartbeat interval, in the wake of the edge's heartbeat, not one of its own."""
PONG_WAIT_S = 2.0
"""How long the PONG may take before the subscription's connection counts as lost."""
SUBSCRIBE_WAIT_S = 5.0
"""How long connecting and subscribing may take."""
TICK_S = 0.15
"""How often the waiting requests are looked at (their deadlines, their clients): by the reader, on its way, while
events arrive; by the ticker, TICK_S later than that (so every 2 * TICK_S), while none do: each of its wakes is
a wake of the edge's process, which costs CPU whatever the code then does (docs/benchmarks.md measures a wake)."""
RETRY_PAUSE_S = 0.5
CANCEL_MARK_TTL_S = 3600
"""How long a cancelled job's mark stays, for a worker yet to pick the job up."""
MAX_SPENT_LOGS = 100_000
"""Spent logs an edge holds to drop at once at most (see EventRelay.drop_log)."""


def add_cancel(pipe: rawpipe.PipelineLike, job_id: str) -> None:
    """Adds a job's cancel to a pipeline: a mark for a worker yet to pick it up, and a word to running workers."""
    pipe.execute_command("SET", keys.cancelled(job_id), 1, "EX", CANCEL_MARK_TTL_S)
    # raw: a Redis Cluster's pipeline refuses its publish method, and sends this to any node (a cluster delivers
    # a message to the subscribers of every node)
    pipe.execute_command("PUBLISH", keys.CANCEL_CHANNEL, job_id)


@dataclass(frozen=True)
class Timing:
    """The relay's deadlines and bounds, from the settings."""

    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 6.0
    redis_down_after_s: float = 2.0
    max_buffered_events: int = 4096
    max_tenant_behind_bytes: int = 16 * 1024 * 1024

    @property
    def takeover_wait_s(self) -> float:
        """How long a job whose owner stopped beating may wait for another worker to take it over: the
        claim's idle time and two supervision rounds, with a margin."""
        return self.heartbeat_ttl_s + 2 * self.heartbeat_interval_s + 2.0


class EventRelay:
    """Holds the edge's subscription and routes each event to its job's queue."""

    def __init__(self, reader: aioredis.Redis, commands: aioredis.Redis, channel: str,
                 timing: Timing | None = None, worker_alive: Callable[[str], bool] | None = None) -> None:
        self.reader = reader
        """A connection of its own: it spends its life subscribed."""
        self.commands = commands
        self.pipelines = rawpipe.Pipelines(commands, keep=False)
        """The heartbeat's writes."""
        self.channel = channel
        self.timing = timing or Timing()
        self.worker_alive = worker_alive
        self.live_edges = 1
        """Edges whose heartbeat was current at this edge's last beat (itself included)."""
        self.connection: Any = None
        self.release: Any = None
        """How a cluster node takes its connection back (None: the reader's own pool)."""
        self.jobs: dict[str, JobEvents] = {}
        """Each job's reader on this edge: the request that registered it last."""
        self.shelved: dict[str, list[JobEvents]] = {}
        """Requests that read a job before a later request of this edge took it over (its stream resumed here while
        the request that began it still waits on a client that left, or a client streaming a background response
        this edge follows): the last one gets the job back, from its log, when the later one ends."""
        self.put_off: list[tuple[JobEvents, bus.Event]] = []
        """Tokens of flowing streams that wait for the woken requests to run first (see `dispatch`)."""
        self.busy = asyncio.Event()
        """Set while jobs are registered: the ticker sleeps without them."""
        self.down_since: float | None = None
        """When reading from Redis began to fail; None while it answers."""
        self.catching_up: asyncio.Task[None] | None = None
        self.last_round = 0.0
        """When the waiting requests were last looked at (the loop's clock)."""
        self.backstop: asyncio.Timeout | None = None
        """The ticker's wait for a round that the reader did not do."""
        self.heard = 0.0
        """When the subscription last brought anything (the loop's clock)."""
        self.pinged_at: float | None = None
        """When a PING went out that nothing has answered yet."""
        self.quiet_check: asyncio.TimerHandle | None = None
        self.spent_logs: list[str] = []
        """Jobs nobody can resume whose end this edge read: their event logs go with the next heartbeat (else they
        stay UNREPLAYABLE_LOG_KEEP_S, uncharged, at any rate a tenant's requests end)."""
        self.unsent_cancels: dict[str, float] = {}
        """Job id -> deadline (monotonic) of the cancels Redis could not take: the heartbeat sends them again until
        one goes through or the job's own deadline ends it (else a job whose client left runs on unread)."""

    def register(self, job_id: str, deadline: float, start_by: float | None = None, tenant: str = "") -> JobEvents:
        """The job's events for a request, from now on (a request of this edge that read them is shelved); a job
        not started by `start_by` ends with queue_timeout; `tenant` is whose it is."""
        events = JobEvents(job_id, deadline, self.read_log, self.timing.max_buffered_events)
        events.start_by, events.tenant = start_by, tenant
        if (earlier := self.jobs.get(job_id)) is not None:
            self.shelved.setdefault(job_id, []).append(earlier)
        self.jobs[job_id] = events
        self.busy.set()
        return events

    def unregister(self, events: JobEvents) -> None:
        """The request of `events` ended: a request it shelved gets the job back and reads what it missed from the
        job's log."""
        job_id = events.job_id
        shelf = self.shelved.get(job_id)
        if self.jobs.get(job_id) is events:
            del self.jobs[job_id]
            if shelf:
                back = self.jobs[job_id] = shelf.pop()
                back.log_unread = True
                back.wake()
        elif shelf and events in shelf:
            shelf.remove(events)
        if shelf is not None and not shelf:
            del self.shelved[job_id]
        if not self.jobs:
            self.busy.clear()

    def readers(self, job_id: str) -> int:
        """The requests of this edge reading the job's events: its reader and those it shelved."""
        return (job_id in self.jobs) + len(self.shelved.get(job_id, ()))

    def reads(self, events: JobEvents) -> bool:
        """Whether `events` is its job's reader on this edge (no later request took the job over)."""
        return self.jobs.get(events.job_id) is events

    async def read_log(self, job_id: str, after: str) -> tuple[list[bus.Event], str, bool]:
        """A page of the job's log; a Redis failure is the stream's error (Unavailable), ended in its format."""
        with redis_boundary():
            return await joblog.read_page(self.commands, job_id, after)

    def redis_down(self) -> bool:
        """True once Redis has not answered for the configured time (new requests are refused at once)."""
        return self.down_since is not None and time.monotonic() - self.down_since >= self.timing.redis_down_after_s

    def dispatch(self, payload: bytes) -> None:
        """Hands a batch's events to their jobs. A batch is an engine step's tokens of many streams, and the tokens
        of streams already flowing are written to their clients right here (`JobEvents.sink`), a socket write
        each; a request still waiting for its first output is a task to wake instead. So those are offered
        first and the flowing streams' tokens just after their tasks have run: a first token that lands in a
        step of 64 streams goes out before the other 63 tokens, not after them."""
        try:
            events = bus.decode_events(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("skipping an undecodable event batch on %s: %s", self.channel, exc)
            return
        flowing: list[tuple[JobEvents, bus.Event]] = []
        woken = False
        size = len(payload) // len(events) if events else 0
        for event in events:
            waiting = self.jobs.get(event.job)
            if waiting is None:  # a job whose client left: nobody waits, drop it
                continue
            waiting.weigh(size)
            if waiting.sink is None:
                waiting.offer(event)
                woken = True
            else:
                flowing.append((waiting, event))
        if self.put_off:  # an earlier batch of this read put its tokens off: these follow them
            self.put_off += flowing
        elif woken and flowing:
            self.put_off = flowing
            asyncio.get_running_loop().call_soon(self._offer_put_off)
        else:
            self._offer(flowing)

    def _offer_put_off(self) -> None:
        flowing, self.put_off = self.put_off, []
        self._offer(flowing)

    def _offer(self, flowing: list[tuple[JobEvents, bus.Event]]) -> None:
        for waiting, event in flowing:
            if self.jobs.get(waiting.job_id) is waiting:  # still its request's (it may have ended meanwhile)
                waiting.offer(event)

    async def run(self) -> None:
        """Listens until cancelled; Redis outages are retried with a short pause."""
        try:
            while True:
                try:
                    await self._subscribe()
                    listener = rawpipe.Listener(self.connection, self._route)
                    self._watch_quiet()
                    raise await listener.ended
                except Exception as exc:  # never die quietly: every waiting request would hang until its deadline
                    self._failed(exc)
                    await self._drop_connection()
                    await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            self._stop_watching()

    def _watch_quiet(self) -> None:
        """One timer for the subscription's quiet spells, which re-arms itself while messages come (a timeout
        per read would cost every token's read a timer), on beats: PING_AFTER_S of quiet sends a PING, and when
        nothing answers it for PONG_WAIT_S the connection is closed, which ends the listening."""
        self.quiet_check = None
        transport = None if self.connection is None else internals.transport(self.connection)
        if transport is None or transport.is_closing():  # its listening ends, or has ended, on its own
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.pinged_at is None:
            due = beats.beat_at(self.heard + PING_AFTER_S, PING_AFTER_S)
            if beats.come(now, due, PING_AFTER_S):
                transport.write(rawpipe.pack(("PING",)))
                self.pinged_at, due = now, beats.beat_at(now + PONG_WAIT_S, PING_AFTER_S)
        elif beats.come(now, due := beats.beat_at(self.pinged_at + PONG_WAIT_S, PING_AFTER_S), PING_AFTER_S):
            log.warning("the subscription on %s went unanswered for %.1f s", self.channel, PONG_WAIT_S)
            transport.abort()
            return
        self.quiet_check = loop.call_at(due, self._watch_quiet)

    def _stop_watching(self) -> None:
        if self.quiet_check is not None:
            self.quiet_check.cancel()
            self.quiet_check = None

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, REDIS_FAILURES):
            log.warning("listening on %s failed (%s); retrying", self.channel, type(exc).__name__)
        else:
            log.exception("listening on %s failed", self.channel)
        if self.down_since is None:
            self.down_since = time.monotonic()
            metrics.REDIS_UP.set(0)

    async def _subscribe(self) -> None:
        """Subscribes on a connection held for good, then reads the logs of the requests already waiting:
        events published before the subscription took hold reached nobody."""
        async with asyncio.timeout(SUBSCRIBE_WAIT_S):
            if self.connection is None:
                self.connection = await self._take_connection()
            await self.connection.send_packed_command(rawpipe.pack(("SSUBSCRIBE", self.channel)), check_health=False)
            while not await self._receive():
                pass
        if self.down_since is not None:
            log.info("listening on %s again after an outage", self.channel)
            self.down_since = None
        metrics.REDIS_UP.set(1)
        if self.jobs:
            self.catching_up = asyncio.create_task(self._catch_up(list(self.jobs.values())))

    async def _catch_up(self, waiting: list[JobEvents]) -> None:
        for events in waiting:
            if self.jobs.get(events.job_id) is events:
                with contextlib.suppress(*REDIS_FAILURES):  # the subscription fails too, and catches up again
                    await events.catch_up()

    async def _receive(self) -> bool:
        """One read of the socket, while subscribing (after that, `rawpipe.Listener` hands each read to
        `_route`); True when the subscription was confirmed."""
        await internals.read_from_socket(self.connection)
        return self._route()

    def _route(self) -> bool:
        """Routes the messages the connection's reader holds whole, taken from hiredis's reader (in C: redis-py's
        read_response costs a few Python calls and a timer per reply); True when one confirmed the
        subscription."""
        reader = internals.hiredis_reader(self.connection)
        self.heard, self.pinged_at = asyncio.get_running_loop().time(), None
        subscribed = False
        while (reply := reader.gets()) is not rawpipe.NOT_ENOUGH_DATA:
            if isinstance(reply, Exception):  # on a cluster, MOVED: the channel's slot is elsewhere now
                raise reply
            kind = reply[0]
            if kind == b"smessage":
                self.dispatch(reply[2])
            elif kind == b"ssubscribe":
                subscribed = True
            elif kind == b"sunsubscribe":  # a cluster moved the channel's slot: subscribe where it is now
                raise RedisConnectionError(f"{self.channel} was unsubscribed by the server")
        if self.jobs and self.down_since is None and self.heard >= self.last_round + TICK_S:
            self._round()  # (in an outage the ticker does them)
        return subscribed

    async def _take_connection(self) -> Any:
        """A connection of the reader's pool; on a cluster, of the node that holds this edge's channel."""
        if isinstance(self.reader, RedisCluster):
            await self.reader.initialize()
            node = self.reader.get_node_from_key(self.channel)
            connection = node.acquire_connection()
            await connection.connect()
            self.release = node.release
            return connection
        return await self.reader.connection_pool.get_connection()

    async def _drop_connection(self) -> None:
        self._stop_watching()
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
        left alone. While events arrive the reader does these rounds as it routes them (`_round`), and pushes
        this wait back: the ticker wakes only when the subscription is quiet."""
        loop = asyncio.get_running_loop()
        while True:
            await self.busy.wait()  # an idle edge has nothing to wake
            due = max(self.last_round + TICK_S, loop.time())
            try:
                async with asyncio.timeout_at(due + TICK_S) as self.backstop:
                    await loop.create_future()  # only the timeout ends it
            except TimeoutError:
                pass
            finally:
                self.backstop = None
            self._round()

    def _round(self) -> None:
        loop = asyncio.get_running_loop()
        self.last_round = loop.time()
        if self.backstop is not None and not self.backstop.expired():  # expired: the ticker is on its way here
            self.backstop.reschedule(self.last_round + 2 * TICK_S)
        now = time.monotonic()
        outage = self.redis_down()
        for events in [*self.jobs.values(), *(e for shelf in self.shelved.values() for e in shelf)]:
            if outage:
                events.fail(unavailable())
            else:
                self._watch_owner(events, now)
                self._watch_start(events, now)
            if events.waiter is not None and (now >= events.deadline or events.watch is None or events.watch()):
                events.wake()
        if self.timing.max_tenant_behind_bytes:
            self._bound_behind()

    def _bound_behind(self) -> None:
        """Each tenant's streaming clients that read slower than their events come hold at most
        max_tenant_behind_bytes of this edge: past it, the tenant's clients furthest behind are dropped (and their
        jobs stopped) until it holds less. Without it, a key that may open any number of streams holds ~1 MB of the
        edge per client that reads nothing (tens with top logprobs) until the write stall drops it."""
        held: dict[str, list[tuple[int, JobEvents]]] = {}
        for events in self.jobs.values():
            if (behind := events.behind_bytes()) and not events.overflowed:
                held.setdefault(events.tenant, []).append((behind, events))
        for streams in held.values():
            total = sum(behind for behind, _ in streams)
            if total <= self.timing.max_tenant_behind_bytes:
                continue
            for behind, events in sorted(streams, key=lambda stream: stream[0], reverse=True):
                events.overflow(f"held {behind} bytes of its tenant's {total} behind on this edge")
                total -= behind
                if total <= self.timing.max_tenant_behind_bytes:
                    break

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

    def _watch_start(self, events: JobEvents, now: float) -> None:
        """A queued job that no worker started in time never will be (a worker refuses one past the queue timeout,
        and one whose only worker died meanwhile may wait for none): its client is told now, not at its deadline."""
        if events.start_by is not None and now > events.start_by and not events.owner and not events.failing:
            events.fail(QueueTimeout("No worker started the request within the queue timeout; it was not started."))

    def drop_log(self, job_id: str) -> None:
        """The job's log is read to its end and nobody may read it again: it goes with the next heartbeat."""
        if len(self.spent_logs) < MAX_SPENT_LOGS:  # past it (Redis down a while) the rest expire by themselves
            self.spent_logs.append(job_id)

    def cancel_later(self, job_id: str, deadline: float) -> None:
        """A cancel that Redis could not take goes out with the next heartbeat that reaches it."""
        self.unsent_cancels[job_id] = deadline

    async def heartbeat(self) -> None:
        """Tells workers this edge still listens on its channel and learns how many edges are alive, and sends the
        cancels an outage held back: one round trip a beat."""
        ttl_ms = int(self.timing.heartbeat_ttl_s * 1000)
        while True:
            now = time.time()
            cancels, spent = self._due_cancels(), self.spent_logs
            self.spent_logs = []
            with contextlib.suppress(*REDIS_FAILURES):
                pipe = self.pipelines.pipeline()
                for job_id in cancels:
                    add_cancel(pipe, job_id)
                for job_id in spent:  # one key a command: a cluster's pipeline sends each to its slot
                    pipe.execute_command("UNLINK", keys.job_log(job_id))
                pipe.execute_command("SET", keys.edges_alive(self.channel), 1, "PX", ttl_ms)
                pipe.execute_command("ZADD", keys.EDGES, now + self.timing.heartbeat_ttl_s, self.channel)
                pipe.execute_command("ZREMRANGEBYSCORE", keys.EDGES, "-inf", now)
                pipe.execute_command("ZCARD", keys.EDGES)
                self.live_edges = max(1, int((await pipe.execute())[-1]))
                for job_id in cancels:
                    del self.unsent_cancels[job_id]
                if cancels:
                    log.info("sent %d cancels held back by an outage", len(cancels))
            await beats.sleep_to_beat(self.timing.heartbeat_interval_s)

    def _due_cancels(self) -> list[str]:
        """The held-back cancels still worth sending (past its deadline, a job has ended by itself)."""
        now = time.monotonic()
        for job_id in [job_id for job_id, deadline in self.unsent_cancels.items() if deadline <= now]:
            del self.unsent_cancels[job_id]
        return list(self.unsent_cancels)

    async def say_goodbye(self) -> None:
        """Workers keep this edge's remaining jobs for a resume elsewhere from now on."""
        with contextlib.suppress(*REDIS_FAILURES):
            pipe = self.commands.pipeline(transaction=False)
            pipe.delete(keys.edges_alive(self.channel))
            pipe.zrem(keys.EDGES, self.channel)
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
