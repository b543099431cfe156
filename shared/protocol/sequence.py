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
    ordered = InOrder()
    taken = ordered.take(events)
    return taken, ordered.stopped


class InOrder:
    """Judges a job's log read a page at a time as `in_order` judges it whole. Each page is in position order, but a
    write repeated after a later one landed may fall on the next page: a later position waits for the ones before
    it, `hold` events at most; past them, or at a conflict, the log stops there (`stopped`)."""

    def __init__(self, hold: int = 0) -> None:
        self.judge = Sequencer()
        self.hold = hold
        self.ahead: dict[int, list[bus.Event]] = {}
        self.held = 0
        self.stopped = False

    def take(self, page: list[bus.Event]) -> list[bus.Event]:
        """The events of the log's next page that follow what was taken, in order."""
        taken: list[bus.Event] = []
        for event in page:
            if self.stopped:
                break
            verdict = self._accept(event, taken)
            if verdict is Verdict.GAP and self.held < self.hold:
                self.ahead.setdefault(event.seq, []).append(event)
                self.held += 1
            elif verdict is Verdict.GAP:
                self.stopped = True
            elif verdict is Verdict.TAKE:
                self._release(taken)
        return taken

    def _accept(self, event: bus.Event, taken: list[bus.Event]) -> Verdict:
        verdict = self.judge.accept(event)
        if verdict is Verdict.TAKE:
            taken.append(event)
        elif verdict is Verdict.CONFLICT:
            self.stopped = True
        return verdict

    def _release(self, taken: list[bus.Event]) -> None:
        """Takes the held events whose position has come (each held position's first; its repeats are dropped)."""
        while not self.stopped and (waiting := self.ahead.pop(self.judge.next_seq, None)) is not None:
            self.held -= len(waiting)
            for event in waiting:
                self._accept(event, taken)
