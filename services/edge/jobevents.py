"""One request's view of its job's events: in order, each position once, from the job's current owner.

The relay offers every event it reads (`offer`); the request takes them (`next`, `ready`). Events are judged
by a shared.protocol.sequence.Sequencer, so a job that moved to another worker continues without a repeat, and a gap
(events the edge never saw, say from a worker that died mid-write) is filled from the job's log before
anything after it goes out. A resumed stream starts with such a gap: everything from position 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from shared.protocol import bus
from shared.protocol.errors import RequestTimeout, StreamAbandoned, TokenbusError, WorkerLost, from_kind, kind_of
from shared.protocol.sequence import Sequencer, Verdict

log = logging.getLogger(__name__)

Sink = Callable[[bus.Event], bool]
"""Takes an event on the spot (True), or leaves it to the waiting request (False)."""
LogReader = Callable[[str, str], Awaitable[tuple[list[bus.Event], str, bool]]]
"""Reads a page of a job's event log after an entry id: (events, the last entry id read, whether more follow)."""
EVENT_BYTES = 64
"""What an event is taken to take on the bus before any of a job's was sized (a token's is about this)."""
LOG_PAGE_EVENTS = 512
"""Events read from the log that may wait for the client before the next page is read: a resumed stream
replays its log a page at a time, as its client takes it, not all at once."""


class JobEvents:
    """The events of one job, in order; iterating ends after the Final event, an Error raises.

    Waiting costs one future per event: no timer per wait. The relay's ticker wakes a waiter a few times a
    second instead when it has something to look at: its deadline, its client, a keep-alive (see `watch`).

    A streaming request installs a `sink` once its stream is open: while the request waits with nothing
    queued, the relay hands each event to the sink, which writes token chunks straight to the client's
    socket. That saves a task switch per token; whatever the sink declines (the end of the stream, errors,
    tokens for a client that is behind) queues for the request as before, so order is kept.
    """

    def __init__(self, job_id: str, deadline: float, log_reader: LogReader | None = None,
                 max_buffered: int = 4096) -> None:
        self.job_id = job_id
        self.max_buffered = max_buffered
        """Events it may hold undelivered; past it its client is dropped and its job stopped."""
        self.deadline = deadline
        self.log_reader = log_reader
        self.sequencer = Sequencer()
        self.buffer: deque[bus.Event] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Sink | None = None
        self.watch: Callable[[], bool] | None = None
        """Whether the waiting request has something to do without an event (its client left, a keep-alive is
        due), for the ticker to wake only those; None: woken on every tick."""
        self.finished = False
        self.failure: TokenbusError | None = None
        """An Error event met by `ready`, raised by the next `next` so that earlier events go out first."""
        self.gap_at: int | None = None
        """A position seen before the ones ahead of it: they are read from the log first."""
        self.failed_with: TokenbusError | None = None
        """The error found at the edge that ends it (see `fail`)."""
        self.overflowed = False
        """Its client fell max_buffered events behind and is being dropped."""
        self.on_overflow: Callable[[], None] | None = None
        """Drops the client (set by the request once its stream is open)."""
        self.start_by: float | None = None
        """When (the monotonic clock) a job this edge queued must have been started by a worker (its owner known),
        else no worker will start it and its request ends with queue_timeout; None: no such bound."""
        self.owner_lost_since: float | None = None
        """When the relay's ticker first saw the job's owner without a heartbeat."""
        self.kept = False
        """Its request left while the job ran on, kept for a resume (see Gateway._let_go)."""
        self.log_cursor = ""
        """The id of the last log entry read: the next read starts after it (an owner only appends)."""
        self.log_unread = False
        """Part of the log is still to be read once the client has taken what was read."""
        self.log_ahead: dict[int, list[bus.Event]] = {}
        """Events read from the log ahead of the next position (a write repeated after a later one landed): they
        are taken when their position comes."""
        self.abandoned = False
        """The job was cancelled before it finished: a log that ends without its end ends the stream."""
        self.reader_revoked = False
        """The key of the request reading it (a resume with another key than the job's own) was revoked: the
        request ends, the job runs on as when a client leaves."""
        self.tenant = ""
        """Whose job it is: what its client is behind counts against that tenant's bound (see behind_bytes)."""
        self.event_bytes = EVENT_BYTES
        """What one of its events takes on the bus, lately (a running average of its batches' sizes)."""
        self.unsent: Callable[[], int] | None = None
        """What was written to its client and not taken yet, in bytes (set by the request once its stream is
        open)."""

    @property
    def failing(self) -> bool:
        """An error found at the edge ends it."""
        return self.failed_with is not None

    @property
    def owner(self) -> str:
        return self.sequencer.owner

    def offer(self, event: bus.Event) -> None:
        """Takes an event from the relay (or the log) if it is the next one of the job's current owner."""
        verdict = self.sequencer.accept(event)
        if verdict is Verdict.TAKE:
            if not isinstance(event, bus.Started):
                self._put(event)
        elif verdict is Verdict.GAP:
            self.gap_at = max(self.gap_at or 0, event.seq)
            self.wake()
        elif verdict is Verdict.CONFLICT:
            self.fail(WorkerLost("The job's worker was lost and its stream cannot be continued."))

    def fail(self, error: TokenbusError) -> None:
        """Ends the job with an error found at the edge, after the events already here."""
        if not self.finished and not self.failing:
            self.failed_with = error
            self._put(bus.Error(job=self.job_id, kind=kind_of(error), message=error.message, code=error.code))

    def _put(self, event: bus.Event) -> None:
        # only while the request waits with nothing queued: everything before this event is written
        if len(self.buffer) >= self.max_buffered and not self.overflowed:
            self.overflow(f"fell {self.max_buffered} events behind")
        if self.sink is not None and self.waiter is not None and not self.buffer:
            try:
                if self.sink(event):
                    return
            except Exception:  # a broken sink must not take the relay down: the request renders it instead
                log.exception("writing an event of job %s directly failed", self.job_id)
                self.sink = None
        self.buffer.append(event)
        self.wake()

    def overflow(self, why: str) -> None:
        """Drops its client, who is too slow (an edge's memory must not grow with it): its job is stopped."""
        if self.overflowed:
            return
        self.overflowed = True
        log.warning("dropping a client of job %s that %s", self.job_id, why)
        if self.on_overflow is not None:
            self.on_overflow()

    def weigh(self, size: int) -> None:
        """Takes in the size one of its events had on the bus (see event_bytes)."""
        self.event_bytes = (3 * self.event_bytes + size) >> 2

    def behind_bytes(self) -> int:
        """What this edge holds for a streaming client that reads slower than its events come: the events waiting
        for it (as sized on the bus) and what it has not taken of what was written; 0 for a request that does not
        stream (it takes every event as it comes)."""
        if self.unsent is None:
            return 0
        return len(self.buffer) * self.event_bytes + self.unsent()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> bus.Output | None:
        """The next event, or None when woken by a tick without one (the caller may send a keep-alive)."""
        if self.failure is not None:
            raise self.failure
        if not self.buffer and (self.gap_at is not None or self.log_unread):
            await self.fill()
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

    async def fill(self) -> None:
        """Reads the events this request missed from the job's log, a page at a time."""
        wanted, self.gap_at = self.gap_at, None
        if self.log_reader is None or not await self.catch_up():
            return
        if wanted is not None and self.sequencer.next_seq <= wanted and not self.finished:
            self.fail(WorkerLost("Events of this stream were lost with its worker."))
        elif self.abandoned and not self.finished and not any(isinstance(e, bus.Final | bus.Error)
                                                               for e in self.buffer):
            self.fail(StreamAbandoned("The stream was cancelled before it finished."))

    async def catch_up(self) -> bool:
        """Offers the job's log after what was read of it (what the edge may have missed while it was not
        subscribed), until its end or until LOG_PAGE_EVENTS wait for the client; True once read to the end."""
        if self.log_reader is None:
            return True
        more = True
        while more and len(self.buffer) < LOG_PAGE_EVENTS:
            events, self.log_cursor, more = await self.log_reader(self.job_id, self.log_cursor)
            for event in events:
                self._offer_logged(event)
        self.log_unread = more
        return not more

    def _offer_logged(self, event: bus.Event) -> None:
        if self.sequencer.judge(event) is Verdict.GAP:
            self.log_ahead.setdefault(event.seq, []).append(event)
            if len(self.log_ahead) > self.max_buffered:  # positions missing for good
                self.fail(WorkerLost("Events of this stream were lost with its worker."))
            return
        self.offer(event)
        while (ahead := self.log_ahead.pop(self.sequencer.next_seq, None)) is not None:
            for event in ahead:
                self.offer(event)

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
        if isinstance(event, bus.Started):
            return None
        if isinstance(event, bus.Final):
            self.finished = True
        return event
