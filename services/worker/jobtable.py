"""The jobs a worker holds: each job's run and task, the ones aborted in the engine, the routes their events take,
and the engine slots they fill."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from services.worker.parsing.output import JobOutput
from services.worker.slots import Slots
from shared.protocol import bus
from shared.tenancy import fairshare

PRIORITY_BAND_SPAN = 1_000_000
"""Engine priorities of one band lie within this span (a tenant's slots over its weight), below a lower band's."""


class Holding(enum.Enum):
    """Whose a job on this worker is. It only ever moves down: OWNED, then GIVEN_UP or GONE, then GONE."""

    OWNED = "owned"
    """This worker's: it publishes the job's events, acknowledges its entry after them and settles what it cost."""
    GIVEN_UP = "given_up"
    """Moved to the dead-letter stream (no acknowledgement is due): its last events are still published and its
    cost settled."""
    GONE = "gone"
    """Handed over, or taken by another worker: nothing more of it is published, acknowledged or settled here."""


@dataclass(eq=False)
class Run:
    """One job on this worker: its place in the job's sequence, where its events go, how it may end."""

    job: bus.Job
    entry_id: bytes
    ticket: fairshare.Ticket | None = None
    """What the fair-share scheduler charged for the job (None: it came without the scheduler)."""
    epoch: int = 1
    next_seq: int = 0
    keep_until_ms: int = 0
    """While its client (or edge) is gone: when to stop waiting for a resume and abort; 0 while attached."""
    holding: Holding = Holding.OWNED
    began: float = 0.0
    """When it reached the engine here (monotonic seconds; 0: it never did)."""
    generated: int = 0
    """Completion tokens this owner published."""
    usage: tuple[int, int] | None = None
    """(prompt, completion) tokens as its Final event reported them."""
    output: JobOutput | None = None
    """The parsers its text goes through (tool calls), if any."""

    @property
    def publishes(self) -> bool:
        """Whether the job's events, and what it cost, are still this worker's to write."""
        return self.holding is not Holding.GONE

    @property
    def acknowledges(self) -> bool:
        """Whether its queue entry is still this worker's to acknowledge (not moved, nor another worker's)."""
        return self.holding is Holding.OWNED

    def give_up(self) -> None:
        """Its entry went to the dead-letter stream."""
        if self.holding is Holding.OWNED:
            self.holding = Holding.GIVEN_UP

    def let_go(self) -> None:
        """Another worker has it now (handed over, or taken while this one stalled)."""
        self.holding = Holding.GONE

    def used(self) -> tuple[int, int]:
        """(prompt, completion) tokens the job used: as its Final event reported them, or, for a job that ended
        early, its prompt estimate (once it started) and the tokens published."""
        if self.usage is not None:
            return self.usage
        carried = self.job.continuation.carried() if self.job.continuation else 0
        started = self.next_seq > 0
        return (self.job.prompt_estimate if started else 0), self.generated + carried

    def settlement(self) -> fairshare.Settlement | None:
        """What the job really cost, to correct its tenant's counter with (None: it has no charge to settle)."""
        if self.ticket is None:
            return None
        if not self.began:
            return self.ticket.settle(0, 0, 0.0)  # never reached the engine here: it used nothing
        prompt, completion = self.used()
        return self.ticket.settle(prompt, completion, (time.monotonic() - self.began) * 1000)


class JobTable:
    """The runs of the jobs a worker holds, by job id, from their read (or claim) to their end."""

    def __init__(self, sequences: int) -> None:
        self.runs: dict[str, Run] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.aborted: dict[str, bool] = {}
        """Jobs aborted in the engine that have not ended yet: whether because nobody came back for them (their log
        ends with a StreamAbandoned error), else because they were cancelled."""
        self.slots = Slots(sequences)
        """One per engine sequence: a job holds as many as it runs sequences, from before its start to its end."""
        self.slot_freed = asyncio.Event()

    def __len__(self) -> int:
        return len(self.runs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.runs

    def get(self, job_id: str) -> Run | None:
        return self.runs.get(job_id)

    def all(self) -> list[Run]:
        return list(self.runs.values())

    def add(self, run: Run, task: asyncio.Task[None]) -> None:
        self.runs[run.job.id] = run
        self.tasks[run.job.id] = task

    def remove(self, run: Run) -> None:
        """Forgets an ended job; whoever waits for a free slot looks again."""
        self.runs.pop(run.job.id, None)
        self.tasks.pop(run.job.id, None)
        self.aborted.pop(run.job.id, None)
        self.slot_freed.set()

    def abort(self, job_id: str, abandoned: bool = False) -> Run | None:
        """Marks a running job aborted; its run, or None when it is not here or was aborted already."""
        run = self.runs.get(job_id)
        if run is None or job_id in self.aborted:
            return None
        self.aborted[job_id] = abandoned
        return run

    def free_slots(self) -> int:
        """Slots new jobs may fill (a read takes at most one job per slot): none while a wide job waits for its own."""
        return self.slots.open()

    async def until_a_job_ends(self) -> None:
        """Waits until a job ends."""
        self.slot_freed.clear()
        await self.slot_freed.wait()

    def route(self, route: bus.Route) -> None:
        """An edge resumed the job (send its events there now), or its client left (keep it a while)."""
        run = self.runs.get(route.job)
        if run is None:
            return
        if route.reply_to:
            run.job.reply_to, run.keep_until_ms = route.reply_to, 0
        elif not run.keep_until_ms:
            run.keep_until_ms = route.keep_until_ms

    def claimed(self) -> list[Run]:
        """The runs whose queue entries are still this worker's."""
        return [run for run in self.runs.values() if run.acknowledges]

    def attached_streams(self) -> list[str]:
        """The edges' streams of the runs whose clients are attached."""
        return sorted({run.job.reply_to for run in self.runs.values() if not run.keep_until_ms})

    def detach(self, gone: set[str], keep_until_ms: int) -> None:
        """The runs of edges that stopped beating wait for a resume until `keep_until_ms`."""
        for run in self.runs.values():
            if run.job.reply_to in gone and not run.keep_until_ms:
                run.keep_until_ms = keep_until_ms

    def standing(self, job: bus.Job) -> int:
        """The job's engine priority, its tenant's fair-share standing here: the slots the tenant's running jobs of
        its band hold, over its weight (a tenant using little goes first); a higher band goes before any of a
        lower one."""
        band = (job.tenant, job.priority)
        held = sum(run.job.sequences() for run in self.runs.values()
                   if run.began and run.job is not job and (run.job.tenant, run.job.priority) == band)
        return int(held / max(job.weight, 1e-3)) - job.priority * PRIORITY_BAND_SPAN
