"""The jobs a worker holds: each job's run (with its phase: attached, detached, aborted, given up, gone) and task,
the routes their events take, and the engine slots they fill."""

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


class Phase(enum.Enum):
    """Where a job on this worker stands; each change is one of Run's transitions.

    ATTACHED <-> DETACHED (its client or edge left; a resume brings it back); either -> CANCELLED or ABANDONED
    (aborted in the engine); any of those four -> GIVEN_UP (its entry went to the dead-letter stream); any -> GONE
    (another worker has it). The first four are this worker's to publish, acknowledge and settle."""

    ATTACHED = "attached"
    """Running for a client that is there."""
    DETACHED = "detached"
    """Its client (or its edge) is gone: it runs on until `keep_until_ms`, for a resume."""
    CANCELLED = "cancelled"
    """Aborted in the engine because its client cancelled it: its log ends with a StreamAbandoned error."""
    ABANDONED = "abandoned"
    """Aborted in the engine because nobody resumed it in time: its log ends with a StreamAbandoned error."""
    GIVEN_UP = "given_up"
    """Moved to the dead-letter stream (no acknowledgement is due): its last events are still published and its
    cost settled."""
    GONE = "gone"
    """Handed over, or taken by another worker: nothing more of it is published, acknowledged or settled here."""


OWNED = frozenset({Phase.ATTACHED, Phase.DETACHED, Phase.CANCELLED, Phase.ABANDONED})
"""The phases of a job this worker owns (its entry included)."""


@dataclass(eq=False)
class Run:
    """One job on this worker: its place in the job's sequence, where its events go, its phase."""

    job: bus.Job
    entry_id: bytes
    ticket: fairshare.Ticket | None = None
    stream: str = ""
    """The stream its entry is on: a worker's own (cache-aware dispatch placed it there), or "" for its model's."""
    """What the fair-share scheduler charged for the job (None: it came without the scheduler)."""
    epoch: int = 1
    next_seq: int = 0
    phase: Phase = Phase.ATTACHED
    keep_until_ms: int = 0
    """While DETACHED: when to stop waiting for a resume and abort it."""
    began: float = 0.0
    """When it reached the engine here (monotonic seconds; 0: it never did)."""
    in_band: bool = False
    """Its slots count in its tenant's band (JobTable.held) until it is removed."""
    generated: int = 0
    """Completion tokens this owner published."""
    usage: tuple[int, int] | None = None
    """(prompt, completion) tokens as its Final event reported them."""
    output: JobOutput | None = None
    """The parsers its text goes through (tool calls), if any."""

    @property
    def publishes(self) -> bool:
        """Whether the job's events, and what it cost, are still this worker's to write."""
        return self.phase is not Phase.GONE

    @property
    def acknowledges(self) -> bool:
        """Whether its queue entry is still this worker's to acknowledge (not moved, nor another worker's)."""
        return self.phase in OWNED

    @property
    def aborted(self) -> bool:
        """Whether it was aborted in the engine (cancelled or abandoned): it is to stop, and its log to say why."""
        return self.phase in (Phase.CANCELLED, Phase.ABANDONED)

    def detach(self, keep_until_ms: int) -> None:
        """Its client or edge left: it waits for a resume until `keep_until_ms` (a first deadline holds); a
        background response waits for nobody."""
        if self.phase is Phase.ATTACHED and not self.job.background:
            self.phase, self.keep_until_ms = Phase.DETACHED, keep_until_ms

    def attach(self, reply_to: str) -> None:
        """Resumed on an edge: its events go there now."""
        self.job.reply_to = reply_to
        if self.phase is Phase.DETACHED:
            self.phase, self.keep_until_ms = Phase.ATTACHED, 0

    def abort(self, abandoned: bool = False) -> bool:
        """Marks it aborted (`abandoned`: nobody came back for it, else cancelled); False when it already was,
        or is no longer this worker's to stop."""
        if self.phase not in (Phase.ATTACHED, Phase.DETACHED):
            return False
        self.phase = Phase.ABANDONED if abandoned else Phase.CANCELLED
        return True

    def give_up(self) -> None:
        """Its entry went to the dead-letter stream."""
        if self.phase in OWNED:
            self.phase = Phase.GIVEN_UP

    def let_go(self) -> None:
        """Another worker has it now (handed over, or taken while this one stalled)."""
        self.phase = Phase.GONE

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
        self.slots = Slots(sequences)
        """One per engine sequence: a job holds as many as it runs sequences, from before its start to its end."""
        self.slot_freed = asyncio.Event()
        self.held: dict[tuple[str, int], int] = {}
        """Slots the jobs on the engine hold, by tenant and band (what `standing` reads)."""

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
        if self.runs.get(run.job.id) is run:
            del self.runs[run.job.id]
            self.tasks.pop(run.job.id, None)
        if run.in_band:
            self._let_go(run)
        self.slot_freed.set()

    def abort(self, job_id: str, abandoned: bool = False) -> Run | None:
        """Marks a running job aborted; its run, or None when it is not here, was aborted already or is no longer
        this worker's to stop."""
        run = self.runs.get(job_id)
        return run if run is not None and run.abort(abandoned) else None

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
            run.attach(route.reply_to)
        else:
            run.detach(route.keep_until_ms)

    def claimed(self) -> list[Run]:
        """The runs whose queue entries are still this worker's."""
        return [run for run in self.runs.values() if run.acknowledges]

    def attached_streams(self) -> list[str]:
        """The edges' streams of the runs whose clients are attached."""
        return sorted({run.job.reply_to for run in self.runs.values() if run.phase is Phase.ATTACHED})

    def detach(self, gone: set[str], keep_until_ms: int) -> None:
        """The runs of edges that stopped beating wait for a resume until `keep_until_ms`."""
        for run in self.runs.values():
            if run.job.reply_to in gone:
                run.detach(keep_until_ms)

    def begin(self, run: Run) -> int:
        """Marks the run's job as on the engine from now and answers its engine priority (`standing`); its slots
        count in its band's from now until the run is removed."""
        job = run.job
        priority = self.standing(job, counted=run.in_band)
        if not run.in_band:
            band = (job.tenant, job.priority)
            self.held[band] = self.held.get(band, 0) + job.sequences()
            run.in_band = True
        run.began = time.monotonic()
        return priority

    def standing(self, job: bus.Job, counted: bool = False) -> int:
        """The job's engine priority, its tenant's fair-share standing here: the slots the tenant's other jobs of
        its band on the engine hold (`counted`: the job's own are among them), over its weight (a tenant using
        little goes first); a higher band goes before any of a lower one. Kept as jobs begin and end: a burst of
        n jobs costs n look-ups, not n * n."""
        held = self.held.get((job.tenant, job.priority), 0) - (job.sequences() if counted else 0)
        return int(held / max(job.weight, 1e-3)) - job.priority * PRIORITY_BAND_SPAN

    def _let_go(self, run: Run) -> None:
        """A begun run's slots leave its band's count."""
        run.in_band = False
        band = (run.job.tenant, run.job.priority)
        left = self.held.get(band, 0) - run.job.sequences()
        if left > 0:
            self.held[band] = left
        else:
            self.held.pop(band, None)
