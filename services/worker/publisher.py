"""Writes token events to each job's log and publishes them to the edges' channels, in one pipelined round trip
per step.

Every job task hands its events to `publish` without waiting; a single flusher sends whatever has
gathered since its last write. Events of one engine step arrive together, so they leave together,
and while one write is in flight the next batch gathers behind it. A write of token events alone does not
wait for its replies: they are read with a later write (at once by one that needs its own, an acknowledgement
or a lookup; by the first token write CONFIRM_AFTER_S after them, when they have long arrived), or by
themselves once the publisher was quiet for CONFIRM_QUIET_S, so that while a stream's tokens flow each costs the
worker one wake, not two (the reply's) nor a timer's; a failure they show sends those events again (positions
make a repeat harmless: edges and logs' readers keep each position once). A job's log entry is written before
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

from shared.protocol import bus, keys
from shared.redisio.rawpipe import Arg, PipelineLike, Pipelines
from shared.runtime import beats, metrics
from shared.tenancy.storage import LOG_ENTRY_BYTES

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.2
WRITE_TIMEOUT_S = 5.0
CONFIRM_AFTER_S = 1.0
"""Replies of token writes this old are read by the next write, before it is sent. Each such read costs the write
a task switch and two changes of the connection's polling: at 0.1 s, a lone stream whose tokens come slowly (vLLM
on a CPU) paid them on many of its tokens, and the worker spent more CPU per token than at 1 s. A failure they
show is found this much later, and its events are written again (see the module's doc)."""
CONFIRM_QUIET_S = 2.0
"""Replies still unread when nothing was written for this long are read by themselves (a stream that stalled);
a job's last write carries its acknowledgement, which reads them at once. Its timer fires on the beats of this
period (shared.runtime.beats): with the default heartbeat interval, in the wake of the worker's heartbeat, not
one of its own, while tokens flow as when they stall."""
MAX_UNCONFIRMED = 32
"""Token writes whose replies may stay unread at once."""
LIVE_BYTES = 1 << 20
"""What one write publishes to one edge at most, as a rule. Redis drops a subscriber whose unsent messages pass its
`client-output-buffer-limit pubsub` (32 MB by default, however fast the subscriber reads: one write's messages are
queued before any is sent), and every stream of that edge then stalls until it has subscribed again and read its
logs: one tenant's large answers (a 2,048-input embeddings job is 3 to 8 MB of vectors) would do that to the
others'. Past it, the jobs with the most bytes in the write send their last event alone, and the edge reads the
rest from their logs (written first, in the same write), as it does for any gap."""


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
    log_bytes: dict[str, int] = field(default_factory=dict)
    """What its log entries take, for the jobs whose logs are sized (set when its commands are made)."""
    notes: list[Any] = field(default_factory=list)
    followups: list[tuple[list[tuple[Arg, ...]], Callable[[list[Any]], None]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.live or self.acks or self.followups)

    @property
    def tokens_only(self) -> bool:
        """Nothing in it needs its replies at once."""
        return not self.acks and not self.followups


def _merged(batches: list[_Batch]) -> _Batch:
    """One batch with the events, acknowledgements and follow-ups of several, in their order."""
    out = _Batch()
    for batch in batches:
        for channel, events in batch.live.items():
            out.live.setdefault(channel, []).extend(events)
        for job_id, events in batch.logs.items():
            out.logs.setdefault(job_id, []).extend(events)
        out.expiries.update(batch.expiries)
        out.acks += batch.acks
        out.notes += batch.notes
        out.followups += batch.followups
    return out


def _within_live_bytes(events: list[bus.Event], size: int) -> list[bus.Event]:
    """An edge's events of one write, down to LIVE_BYTES where it can be: the jobs with the most bytes first send
    only their last event (a later position than the edge has: it reads the ones between from the job's log). A
    job with one event sends it whole, however large: nothing after it would tell the edge to read the log."""
    per_job: dict[str, list[bus.Event]] = {}
    for event in events:
        per_job.setdefault(event.job, []).append(event)
    sizes = {job: len(bus.encode_events(own)) for job, own in per_job.items() if len(own) > 1}
    cut: set[str] = set()
    for job in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if size <= LIVE_BYTES:
            break
        cut.add(job)
        size -= sizes[job]
    return [event for event in events if event.job not in cut or event is per_job[event.job][-1]]


class EventPublisher:
    """Batches events per edge channel and per job log; acknowledges jobs after their last event is written."""

    def __init__(self, redis: aioredis.Redis, log_max_events: int, after_acks: AckFollowup | None = None) -> None:
        self.redis = redis
        self.pipelines = Pipelines(redis)
        self.log_max_events = log_max_events
        self.after_acks = after_acks
        self.batch = _Batch()
        self.unconfirmed: list[_Batch] = []
        """Token writes sent with their replies left unread (see the module's doc), oldest first."""
        self.unconfirmed_since = 0.0
        self.last_sent = 0.0
        """When the latest write with its replies unread went out (the loop's clock)."""
        self.quiet_check: asyncio.TimerHandle | None = None
        self.confirm_due = False
        """The replies left unread are to be read by themselves: nothing was written for CONFIRM_QUIET_S."""
        self.soon = False
        """A write is scheduled for when the ready callbacks have run."""
        self.writing = False
        """The flusher task is writing: what gathers meanwhile goes after it."""
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.log_sizes: dict[str, int] = {}
        """Bytes written to each sized job's log so far (see size_log)."""
        self.log_bounds: dict[str, int] = {}
        """Entries the log of a job that keeps more than `log_max_events` keeps (see keep_log)."""

    def publish(self, reply_to: str, event: bus.Event, log_ttl_ms: int = 0) -> None:
        """Queues an event (stamped already) for its edge and its job's log; `log_ttl_ms` sets the log's expiry."""
        self.batch.live.setdefault(reply_to, []).append(event)
        self.batch.logs.setdefault(event.job, []).append(event)
        if log_ttl_ms:
            self.batch.expiries[event.job] = log_ttl_ms
        self._wake()

    def size_log(self, job_id: str) -> None:
        """Counts from now on what the job's log entries take, until logged_bytes takes the count."""
        self.log_sizes.setdefault(job_id, 0)

    def keep_log(self, job_id: str, entries: int) -> None:
        """The job's log keeps its last `entries` entries, if more than --replay-max-events, until release_log."""
        if entries > self.log_max_events:
            self.log_bounds[job_id] = entries

    def release_log(self, job_id: str) -> None:
        self.log_bounds.pop(job_id, None)

    def logged_bytes(self, job_id: str) -> int:
        """What the job's log entries written since size_log took (those written, not those still queued), and
        stops counting them."""
        return self.log_sizes.pop(job_id, 0)

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
        """Writes what gathered once the callbacks ready now have run (the other jobs of the same engine step):
        a write of tokens alone at once from a callback, anything else by the flusher task."""
        self.idle.clear()
        if not self.soon:
            self.soon = True
            asyncio.get_running_loop().call_soon(self._write_soon)

    def _write_soon(self) -> None:
        """Sends a batch of tokens alone on the spot, with no task switch, when nothing else is under way and no
        replies are due to be read; otherwise hands the batch to the flusher task."""
        self.soon = False
        batch, held = self.batch, self.pipelines.held
        if not batch and not self.confirm_due:
            return
        now = asyncio.get_running_loop().time()
        if (held is None or self.writing or self.confirm_due or not batch.tokens_only or self._replies_due(now)
                or not held.try_send_unread(self._commands(batch))):
            self.wakeup.set()
            return
        self.batch = _Batch()
        self._sent_unread(batch, now)

    def _replies_due(self, now: float) -> bool:
        """Replies left unread are to be read before the next write: they are CONFIRM_AFTER_S old, or too many."""
        return bool(self.unconfirmed) and (now - self.unconfirmed_since >= CONFIRM_AFTER_S
                                           or len(self.unconfirmed) >= MAX_UNCONFIRMED)

    def _sent_unread(self, batch: _Batch, now: float) -> None:
        if not self.unconfirmed:
            self.unconfirmed_since = now
        self.last_sent = now
        self.unconfirmed.append(batch)
        self._watch_quiet()
        self._count(batch)

    async def run(self) -> None:
        """Flushes until cancelled; replies left unread are read by themselves once it was quiet CONFIRM_QUIET_S."""
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            confirm, self.confirm_due = self.confirm_due, False
            await self._flush(confirm=confirm)

    def _watch_quiet(self) -> None:
        """One timer for the replies left unread, which re-arms itself while writes go on: a timer per write would
        cost each token more than the wake it saves."""
        if self.quiet_check is None:
            self.quiet_check = asyncio.get_running_loop().call_at(self._quiet_due(), self._quiet)

    def _quiet_due(self) -> float:
        """The first beat at least CONFIRM_QUIET_S after the latest write left unread."""
        return beats.beat_at(self.last_sent + CONFIRM_QUIET_S, CONFIRM_QUIET_S)

    def _quiet(self) -> None:
        self.quiet_check = None
        if not self.unconfirmed:
            return
        if beats.come(asyncio.get_running_loop().time(), self._quiet_due(), CONFIRM_QUIET_S):
            self.confirm_due = True
            self._wake()
        else:
            self._watch_quiet()

    async def flush(self) -> None:
        """Writes what was published so far, and reads every reply left unread."""
        await self._flush(confirm=True)

    async def _flush(self, confirm: bool) -> None:
        batch, self.batch = self.batch, _Batch()
        self.writing = True  # what is published meanwhile waits for this write: the order on the wire is kept
        try:
            if batch or (confirm and self.unconfirmed):
                await self._write(batch, confirm)
        finally:
            self.writing = False
        if not self.batch and not self.unconfirmed:
            self.idle.set()

    def _commands(self, batch: _Batch) -> list[tuple[Arg, ...]]:
        commands: list[tuple[Arg, ...]] = []
        for job_id, events in batch.logs.items():
            payload = bus.encode_events(events)
            commands.append(("XADD", keys.job_log(job_id), "MAXLEN", "~",
                             self.log_bounds.get(job_id, self.log_max_events), "*", bus.EVENTS_FIELD, payload))
            if job_id in self.log_sizes:
                batch.log_bytes[job_id] = len(payload) + LOG_ENTRY_BYTES
            if ttl_ms := batch.expiries.get(job_id):
                commands.append(("PEXPIRE", keys.job_log(job_id), ttl_ms))
        for channel, events in batch.live.items():
            payload = bus.encode_events(events)
            if len(payload) > LIVE_BYTES:
                payload = bus.encode_events(_within_live_bytes(events, len(payload)))
            commands.append(("SPUBLISH", channel, payload))
        for stream, group, entry_id in batch.acks:
            commands.append(("XACK", stream, group, entry_id))
            commands.append(("XDEL", stream, entry_id))
        return commands

    async def _write(self, batch: _Batch, confirm: bool) -> None:
        held = self.pipelines.held
        if held is not None and not confirm and batch.tokens_only:
            now = asyncio.get_running_loop().time()
            if self._replies_due(now) and (failed := await self._unconfirmed_failed()):  # they arrived meanwhile
                await self._write_confirmed(_merged([*failed, batch]))
                return
            try:
                await held.send_unread(self._commands(batch))
            except (RedisError, OSError) as exc:
                log.warning("writing %d event batches failed (%s); retrying", len(batch.live), exc)
            else:
                self._sent_unread(batch, now)
                return
        if self.unconfirmed:
            batch = _merged([*await self._unconfirmed_failed(), batch])
            if not batch:
                return
        await self._write_confirmed(batch)

    async def _unconfirmed_failed(self) -> list[_Batch]:
        """Reads the replies left unread; the batches they belong to, all of them, if one shows a failure."""
        assert self.pipelines.held is not None  # nosec B101: an invariant (tokenbus never runs with -O)
        sent, self.unconfirmed = self.unconfirmed, []
        try:
            replies = await self.pipelines.held.read_unread()
        except (RedisError, OSError) as exc:
            log.warning("a write of %d event batches may have failed (%s); writing them again", len(sent), exc)
            return sent
        if failure := next((reply for reply in replies if isinstance(reply, Exception)), None):
            log.warning("a write of %d event batches failed (%s); writing them again", len(sent), failure)
            return sent
        return []

    async def _write_confirmed(self, batch: _Batch) -> None:
        while True:
            pipe = self.pipelines.pipeline()
            for command in self._commands(batch):
                pipe.execute_command(*command)
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
        self._count(batch)
        if self.after_acks is not None and acked > essential:
            self.after_acks.done(results[essential:acked])
        at = acked
        for commands, on_replies in batch.followups:
            on_replies(results[at:at + len(commands)])
            at += len(commands)

    def _count(self, batch: _Batch) -> None:
        for job_id, size in batch.log_bytes.items():
            if job_id in self.log_sizes:
                self.log_sizes[job_id] += size
        metrics.EVENT_FLUSHES.inc()
        metrics.EVENTS_PUBLISHED.inc(sum(map(len, batch.live.values())))

    async def drain(self, timeout_s: float) -> None:
        """Waits until everything published so far is written and its replies read, at most `timeout_s`: replies
        left unread are read at once, not when the quiet check comes (a worker handing its jobs over waits on it)."""
        if self.unconfirmed:
            self.confirm_due = True
            self._wake()
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("unwritten events left after %.1f s", timeout_s)
