"""A worker's upkeep: its heartbeat (with the renewal of its scheduler offer and the reads of a supervision round,
one round trip), the supervision those reads feed (its claims kept, gone edges and clients noticed, dead workers'
jobs claimed), and the channel that brings cancels and resumed streams' routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from services.worker.intake import Intake, Marks
from services.worker.jobrun import Engine, JobRunner
from services.worker.jobtable import JobTable, Phase, Run
from services.worker.ownership import Ownership
from services.worker.prefix_summary import PrefixSummary
from services.worker.scheduling import SchedulerLink
from shared.protocol import bus, keys
from shared.redisio import clients as redis_clients
from shared.redisio import rawpipe
from shared.runtime import beats

log = logging.getLogger(__name__)


class UpkeepSettings(Protocol):
    """The settings the upkeep reads (Settings has them)."""

    @property
    def heartbeat_interval_s(self) -> float: ...
    @property
    def heartbeat_ttl_s(self) -> float: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def resume_window_s(self) -> float: ...
    @property
    def task(self) -> str: ...


FORGET_CONSUMERS_EVERY = 10
"""Supervision rounds between two sweeps for dead consumers of the group."""


@dataclass
class RoundReads:
    """The reads of one supervision round, which ride a heartbeat's write: each a named span of that write, whose
    replies are taken by name once it is back."""

    runs: list[Run]
    """The runs whose claims are refreshed."""
    streams: list[str]
    """The edges' streams of attached runs, whose edges' liveness is read."""
    claims: int
    """Entries of dead workers to claim at most (free slots); 0 reads none."""
    backlog: rawpipe.Span
    """The reads of the model's queue, for its gauges."""
    refresh: rawpipe.Span
    """The refresh of the runs' claims (none without runs)."""
    alive: rawpipe.Span
    """One liveness read per stream of `streams`."""
    claim: rawpipe.Span
    """The claim of dead workers' entries (none when `claims` is 0)."""
    rescue: rawpipe.Span
    """The move of jobs left on other workers' own streams back to the model's (none while claims are held)."""
    replies: list[Any] = field(default_factory=list)
    """The whole write's replies, the heartbeat's own included."""


class Upkeep:
    """The loops that keep a worker known, its jobs its own and its clients heard."""

    def __init__(self, settings: UpkeepSettings, engine: Engine, worker_id: str, jobs: JobTable, runner: JobRunner,
                 intake: Intake, scheduler: SchedulerLink, ownership: Ownership, redis: aioredis.Redis,
                 channels: aioredis.Redis, prefixes: PrefixSummary) -> None:
        self.settings = settings
        self.engine = engine
        self.worker_id = worker_id
        self.model = settings.model
        self.jobs = jobs
        self.runner = runner
        self.intake = intake
        self.scheduler = scheduler
        self.ownership = ownership
        self.redis = redis
        self.channels = channels
        """The cancel and route subscription: quiet for long stretches, so no socket timeout."""
        self.prefixes = prefixes
        """What the engine holds, written with each heartbeat."""
        self.stopping = False
        """Set when the worker stops: its offer lapses and it claims nothing more."""
        self.forgotten = False
        """Set once the heartbeat is removed: no beat may write it again."""
        self.beating = asyncio.Lock()
        """Held while a beat's write is in flight, so that `forget` removes the heartbeat after it, not before."""
        self.beats = rawpipe.Pipelines(redis, keep=False)
        """The heartbeat's write, with the offer's renewal and a supervision round's reads: one round trip a beat,
        raw (redis-py's pipeline costs an idle worker more CPU than everything else it does)."""
        self.round_read: asyncio.Queue[RoundReads] = asyncio.Queue(maxsize=1)
        self.claims_after = 0.0
        """No claims before this time (monotonic): after an outage every entry has grown idle, and the entries of
        live workers must not be taken before their owners have had a heartbeat's TTL to refresh them."""

    async def listen(self) -> None:
        """Cancels and routes, as they are published; after the subscription was down, what they would have said."""
        while True:
            pubsub = None
            try:
                pubsub = await redis_clients.subscriber(self.channels)
                await pubsub.subscribe(keys.CANCEL_CHANNEL, keys.ROUTE_CHANNEL)
                if self.jobs:
                    await self._catch_up_on_messages()
                async for message in pubsub.listen():
                    if message["channel"] == keys.ROUTE_CHANNEL.encode():
                        self.jobs.route(bus.decode_route(message["data"]))
                    else:
                        await self.runner.abort(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()

    async def _catch_up_on_messages(self) -> None:
        """What the cancels and routes published while the subscription was down would have said to the running
        jobs (they reached nobody): read from the marks their senders leave, once subscribed again."""
        runs = self.jobs.all()
        pipe = self.redis.pipeline(transaction=False)
        for command in Marks.commands([run.job.id for run in runs]):
            pipe.execute_command(*command)
        for run, found in zip(runs, Marks.read(await pipe.execute()), strict=True):
            if found.reply_to and found.reply_to != run.job.reply_to:
                self.jobs.route(bus.Route(job=run.job.id, reply_to=found.reply_to))
            if found.cancelled:
                await self.runner.abort(run.job.id)

    async def heartbeat(self) -> None:
        """Every heartbeat interval, one round trip: the heartbeat, the renewal of the scheduler's offer, and the
        reads of a supervision round, whose replies go to `supervise`. Acting on them is left to that task: a
        slow round must not hold up the heartbeat."""
        key = keys.worker_heartbeat(self.model, self.worker_id)
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        while not self.forgotten:
            async with self.beating:
                if self.forgotten:
                    return
                await self._beat(key, ttl_ms)
            await beats.sleep_to_beat(self.settings.heartbeat_interval_s)

    def _features(self) -> list[str]:
        """What of the bus it takes (bus.WORKER_FEATURES), and whether it scores prompts (bus.PROMPT_SCORES)."""
        return [*bus.WORKER_FEATURES, *(() if self.engine.max_loras else (bus.PROMPT_SCORES,))]

    async def _beat(self, key: str, ttl_ms: int) -> None:
        info = bus.encode_info(bus.WorkerInfo(
            worker=self.worker_id, model=self.model, task=self.settings.task,
            max_model_len=self.engine.max_model_len, dimensions=self.engine.dimensions,
            slots=self.settings.max_num_seqs, running=self.jobs.slots.used,
            adapters=self.engine.static_adapters(), max_loras=self.engine.max_loras,
            held=self.engine.held_adapters(), features=self._features(),
        ))
        pipe = self.beats.pipeline()
        with rawpipe.Span(pipe) as beat:
            pipe.execute_command("SET", key, info, "PX", ttl_ms)
            pipe.execute_command("ZADD", keys.WORKERS, time.time() + self.settings.heartbeat_ttl_s, key)
        with rawpipe.Span(pipe) as renewal:
            if not self.stopping:  # a full worker pulls nothing, but its offer must not lapse
                self.scheduler.renew(pipe)
        with rawpipe.Span(pipe) as summary:
            held = self.prefixes.write(pipe)
        reads = self._read_round(pipe)
        try:
            results = await pipe.execute(raise_on_error=False)
            if failed := next((r for r in beat.of(results) if isinstance(r, Exception)), None):
                raise failed
        except (RedisError, OSError) as exc:
            log.warning("heartbeat failed (%s)", exc)
            self.claims_after = math.inf
        else:
            if self.claims_after == math.inf:
                self.claims_after = time.monotonic() + self.settings.heartbeat_ttl_s
                self.prefixes.lost()  # its set may have expired meanwhile: all of it is written next beat
            else:
                self.prefixes.written(held, summary.of(results))
            if renewed := renewal.of(results):
                self.scheduler.renewed(renewed[0])
            reads.replies = results
            if not self.round_read.full():  # else the round before is still being acted on: this one waits
                self.round_read.put_nowait(reads)

    async def forget(self) -> None:
        """The heartbeat removed, so that edges stop counting this worker at once (it stops). Its entry in the
        registry stays until edges prune it: meanwhile a model left with no live worker is one that restarts
        (a 503 to retry), not one that does not exist. No beat writes the heartbeat again, not even one in flight."""
        self.forgotten = True
        async with self.beating:
            await self._remove_heartbeat()

    async def _remove_heartbeat(self) -> None:
        heartbeat = keys.worker_heartbeat(self.model, self.worker_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(heartbeat)
        self.prefixes.forget(pipe)
        await pipe.execute()

    def _read_round(self, pipe: rawpipe.PipelineLike) -> RoundReads:
        """Adds a supervision round's reads to the heartbeat's write: the queue's gauges, a refresh of our claims,
        whether the edges of attached jobs still beat, and a claim of dead workers' jobs into free slots."""
        runs = self.jobs.claimed()
        streams = self.jobs.attached_streams()
        claims = 0 if self._holding_claims() else max(0, self.jobs.free_slots())
        with rawpipe.Span(pipe) as backlog:
            self.scheduler.read_backlog(pipe)
        with rawpipe.Span(pipe) as refresh:
            if runs:
                self.ownership.read_refresh(pipe, runs)
        with rawpipe.Span(pipe) as alive:
            for stream in streams:
                pipe.execute_command("EXISTS", keys.edges_alive(stream))
        with rawpipe.Span(pipe) as claim:
            if claims:
                self.ownership.read_claim(pipe, int(self.settings.heartbeat_ttl_s * 1000), claims)
        with rawpipe.Span(pipe) as rescue:
            if not self._holding_claims():
                self.ownership.read_rescue(pipe, int(self.settings.heartbeat_ttl_s * 1000))
        return RoundReads(runs, streams, claims, backlog, refresh, alive, claim, rescue)

    def _holding_claims(self) -> bool:
        return self.stopping or self.round_read.full() or time.monotonic() < self.claims_after

    async def supervise(self) -> None:
        """Each heartbeat's supervision round: keep our claims, notice gone edges and clients, take over dead
        workers' jobs."""
        rounds = 0
        while True:
            reads = await self.round_read.get()
            rounds += 1
            try:
                await self._act_on(reads)
                if rounds % FORGET_CONSUMERS_EVERY == 0:
                    await self.ownership.forget_dead_consumers()
            except (RedisError, OSError) as exc:
                log.warning("supervision round failed (%s)", exc)

    async def _act_on(self, reads: RoundReads) -> None:
        replies = reads.replies
        self.scheduler.count(reads.backlog.of(replies))
        if claim := reads.claim.of(replies):  # first: the entries are ours now, whatever fails below
            self.intake.claimed(self.ownership.claimed(claim[0]))
        gone = {stream for stream, reply in zip(reads.streams, reads.alive.of(replies), strict=True) if reply == 0}
        self.jobs.detach(gone, bus.now_ms() + int(self.settings.resume_window_s * 1000))
        if rescued := reads.rescue.of(replies):
            await self._rescued(rescued[0])
        if refresh := reads.refresh.of(replies):
            for run in await self.ownership.lost(refresh, reads.runs):
                if run.job.id not in self.jobs:  # it ended (its entry acknowledged) since the round's read
                    continue
                # we stalled and another worker took it: stop without a word
                log.warning("job %s was taken over by another worker; stopping it here", run.job.id)
                run.let_go()
                await self.engine.abort(run.job.id)
        await self._expire_detached()

    async def _rescued(self, reply: Any) -> None:
        """Takes the reply of a rescue; a Redis that lost the script runs it again, loading it."""
        if isinstance(reply, NoScriptError):
            reply = await self.ownership.rescue(int(self.settings.heartbeat_ttl_s * 1000))
        elif isinstance(reply, Exception):
            raise reply
        if moved := int(reply):
            log.info("moved %d jobs left on stopped workers' own streams back to the model's stream", moved)

    async def _expire_detached(self) -> None:
        now = bus.now_ms()
        for run in self.jobs.all():
            if run.phase is Phase.DETACHED and now >= run.keep_until_ms:
                await self.runner.abort(run.job.id, abandoned=True)
