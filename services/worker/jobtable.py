"""The jobs a worker holds: each job's run and task, the ones aborted in the engine, the routes their events take,
and the engine slots they fill."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.worker.parsing.output import JobOutput
from services.worker.slots import Slots
from shared import bus, fairshare

PRIORITY_BAND_SPAN = 1_000_000
"""Engine priorities of one band lie within this span (a tenant's slots over its weight), below a lower band's."""


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
    muted: bool = False
    """Handed over or lost to another worker: nothing more of it may be published."""
    released: bool = False
    """Its queue entry was acknowledged or moved already (hand-over, dead letter) or belongs to another worker."""
    abandoned: bool = False
    """Aborted because nobody came back for it: its log ends with a StreamAbandoned error."""
    began: float = 0.0
    """When it reached the engine here (monotonic seconds; 0: it never did)."""
    generated: int = 0
    """Completion tokens this owner published."""
    usage: tuple[int, int] | None = None
    """(prompt, completion) tokens as its Final event reported them."""
    output: JobOutput | None = None
    """The parsers its text goes through (tool calls), if any."""

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
        self.aborted: set[str] = set()
        """Jobs aborted in the engine (cancelled, or abandoned by their clients) that have not ended yet."""
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
        self.aborted.discard(run.job.id)
        self.slot_freed.set()

    def abort(self, job_id: str) -> Run | None:
        """Marks a running job aborted; its run, or None when it is not here or was aborted already."""
        run = self.runs.get(job_id)
        if run is None or job_id in self.aborted:
            return None
        self.aborted.add(job_id)
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
        return [run for run in self.runs.values() if not run.released]

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
