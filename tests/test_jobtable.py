"""The worker's job table alone, without Redis or an engine: which runs it holds, aborts, routes, detaches, and the
engine priority of a tenant's next job."""

from __future__ import annotations

import asyncio
import uuid

from services.worker.jobtable import PRIORITY_BAND_SPAN, JobTable, Phase, Run
from shared.protocol import bus


def _run(tenant: str = "", priority: int = 0, reply_to: str = "edge-a") -> Run:
    job = bus.Job(id=f"test-{uuid.uuid4().hex}", model="m", reply_to=reply_to, deadline_ms=bus.now_ms() + 60_000,
                  messages=[bus.Message(role="user", content="Hi")], tenant=tenant, priority=priority)
    return Run(job, b"1-0")


async def _held(table: JobTable, run: Run) -> None:
    table.add(run, asyncio.create_task(asyncio.sleep(0)))


def test_a_job_given_up_still_publishes_and_one_let_go_does_nothing_more_here() -> None:
    owned, given_up, gone, both = _run(), _run(), _run(), _run()
    given_up.give_up()
    gone.let_go()
    both.give_up()
    both.let_go()
    gone.give_up()  # a job another worker has stays that worker's
    assert [(r.phase, r.publishes, r.acknowledges) for r in (owned, given_up, gone, both)] == [
        (Phase.ATTACHED, True, True), (Phase.GIVEN_UP, True, False), (Phase.GONE, False, False),
        (Phase.GONE, False, False)]


async def test_a_job_is_aborted_once_and_forgotten_when_it_ends() -> None:
    table, run = JobTable(4), _run()
    await _held(table, run)
    assert run.job.id in table and len(table) == 1
    assert table.abort(run.job.id, abandoned=True) is run and table.abort(run.job.id) is None  # once only
    assert run.aborted and run.phase is Phase.ABANDONED and table.abort("not-here") is None
    assert run.publishes and run.acknowledges  # an aborted job still ends here: its last event, its ack
    table.remove(run)
    assert run.job.id not in table and table.slot_freed.is_set()


def test_a_job_no_longer_this_workers_is_not_aborted_here() -> None:
    given_up, gone, cancelled = _run(), _run(), _run()
    given_up.give_up()
    gone.let_go()
    assert cancelled.abort()
    assert not given_up.abort() and not gone.abort() and not cancelled.abort(abandoned=True)
    assert (given_up.phase, gone.phase, cancelled.phase) == (Phase.GIVEN_UP, Phase.GONE, Phase.CANCELLED)
    cancelled.let_go()  # taken by another worker after all: nothing of it is published here
    assert not cancelled.publishes and not cancelled.aborted


async def test_a_route_moves_a_job_to_a_new_edge_or_keeps_it_for_a_resume() -> None:
    table, run = JobTable(4), _run()
    await _held(table, run)
    table.route(bus.Route(job=run.job.id, keep_until_ms=5))
    table.route(bus.Route(job=run.job.id, keep_until_ms=9))  # the first deadline holds
    assert (run.phase, run.keep_until_ms) == (Phase.DETACHED, 5) and table.attached_streams() == []
    table.route(bus.Route(job=run.job.id, reply_to="edge-b"))
    assert (run.phase, run.job.reply_to) == (Phase.ATTACHED, "edge-b") and table.attached_streams() == ["edge-b"]
    table.detach({"edge-a"}, 6)  # not its edge
    assert run.phase is Phase.ATTACHED
    table.detach({"edge-b"}, 7)
    assert (run.phase, run.keep_until_ms) == (Phase.DETACHED, 7)


async def test_a_tenants_standing_counts_its_running_jobs_of_its_band_only() -> None:
    table = JobTable(8)
    runs = [_run("a"), _run("a"), _run("a", priority=1), _run("b")]
    for run in runs:
        await _held(table, run)
    assert [table.begin(run) for run in runs] == [0, 1, -PRIORITY_BAND_SPAN, 0]  # each counts those before it
    runs[1].give_up()
    assert table.standing(_run("a").job) == 2
    assert table.standing(_run("a", priority=1).job) == 1 - PRIORITY_BAND_SPAN
    assert table.standing(_run("c").job) == 0
    assert table.claimed() == [runs[0], runs[2], runs[3]]


async def test_a_jobs_slots_leave_its_tenants_standing_when_it_ends_and_count_once() -> None:
    table = JobTable(8)
    wide = _run("a")
    wide.job.params.n = 3
    first, later = wide, _run("a")
    for run in (first, later):
        await _held(table, run)
        table.begin(run)
    assert table.begin(first) == 1  # begun again (its engine run retried): the others' slots, not its own twice
    assert table.standing(_run("a").job) == 4
    table.remove(first)
    table.remove(first)  # removed twice: let go once
    assert table.standing(_run("a").job) == 1
    table.remove(later)
    assert table.standing(_run("a").job) == 0 and table.held == {}
