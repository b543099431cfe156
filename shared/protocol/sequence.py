"""One job's events in order, each position once, from its current owner: the fenced hand-over.

A worker numbers a job's events 0, 1, 2, ... and stamps them with its epoch; a worker that takes the job
over writes `Started` at the next free position under a higher epoch and carries on from there. A reader
(the edge serving the client, a worker reading the log) judges each event it meets:

    TAKE      the next position, from the current owner (a higher epoch's Started makes it the owner)
    DROP      a position already taken, or anything from a former owner
    GAP       a later position: something in between was missed, read it from the job's log first
    CONFLICT  a new owner began behind what was already taken: the job cannot continue faithfully
"""

from __future__ import annotations

import enum

from shared.protocol import bus


class Verdict(enum.Enum):
    TAKE = "take"
    DROP = "drop"
    GAP = "gap"
    CONFLICT = "conflict"


class Sequencer:
    """The judge of one job's events; `accept` advances on TAKE."""

    def __init__(self) -> None:
        self.epoch = 0
        self.next_seq = 0
        self.owner = ""
        """The worker that owns the job now, as its last Started said ("" before any)."""

    def accept(self, event: bus.Event) -> Verdict:
        verdict = self.judge(event)
        if verdict is Verdict.TAKE:
            self.next_seq += 1
            self.epoch = max(self.epoch, event.epoch)
            if isinstance(event, bus.Started):
                self.owner = event.worker
        return verdict

    def judge(self, event: bus.Event) -> Verdict:
        if event.epoch < self.epoch:
            return Verdict.DROP
        if event.seq < self.next_seq:
            new_owner = isinstance(event, bus.Started) and event.epoch > self.epoch
            return Verdict.CONFLICT if new_owner else Verdict.DROP
        if event.seq > self.next_seq:
            return Verdict.GAP
        return Verdict.TAKE


def in_order(events: list[bus.Event]) -> tuple[list[bus.Event], bool]:
    """The events a reader takes from a job's log, in order, and whether the log holds a conflict; positions
    missing at the start (a trimmed log) count as a conflict too."""
    judge = Sequencer()
    taken: list[bus.Event] = []
    for event in events:
        verdict = judge.accept(event)
        if verdict is Verdict.TAKE:
            taken.append(event)
        elif verdict is not Verdict.DROP:
            return taken, True
    return taken, False
