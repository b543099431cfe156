"""The fair-share scheduler's scripts against a real Redis, with a stand-in worker that takes jobs through the
consumer group and ends them as a worker does (acknowledge, delete, settle): order by counter, weights, strict
priority bands, no burst for a tenant back from idle, work conservation, and admission bounds."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from shared.protocol import bus, keys
from shared.protocol.errors import QueueFull, TenantQueueFull, TokenbusError, WaitExceedsDeadline
from shared.redisio import clients as redis_clients
from shared.runtime.settings import Settings
from shared.tenancy import fairshare

PROMPT, OUTPUT = 10, 100
"""Every job's estimate; with the default weights (1 and 2) it charges 210 / weight."""


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = redis_clients.pooled(redis_url, "test-fairshare", 4)
    yield client
    await client.aclose()


def make_job(model: str, tenant: str, weight: float = 1.0, priority: int = 0, deadline_s: float = 600,
             output: int = OUTPUT) -> bus.Job:
    return bus.Job(id=f"{tenant}-{uuid.uuid4().hex[:8]}", model=model, reply_to="events", tenant=tenant,
                   deadline_ms=bus.now_ms() + int(deadline_s * 1000), created_ms=bus.now_ms(), weight=weight,
                   priority=priority, prompt_estimate=PROMPT, output_budget=output)


@dataclass
class Pool:
    """One model's scheduler and a stand-in worker with `slots` that ends jobs on demand."""

    redis: aioredis.Redis
    scheduler: fairshare.Scheduler
    slots: int
    model: str = field(default_factory=lambda: f"model-{uuid.uuid4().hex[:8]}")

    async def start(self) -> None:
        await self.scheduler.load()
        await self.redis.xgroup_create(keys.requests_stream(self.model), keys.WORKER_GROUP, id="0", mkstream=True)

    async def enqueue(self, job: bus.Job) -> fairshare.Admitted | TokenbusError:
        pipe = self.redis.pipeline(transaction=False)
        self.scheduler.enqueue(pipe, job, bus.encode_job(job))
        return fairshare.outcome((await pipe.execute())[0])

    async def offer(self, slots: int | None = None, ttl_ms: int = 60_000) -> int:
        offer = fairshare.Offer("w", self.slots if slots is None else slots, ttl_ms)
        return (await self.scheduler.dispatch(self.model, offer)).sent

    async def take(self) -> list[tuple[bytes, bus.Job, fairshare.Ticket | None]]:
        """What the worker reads: every job delivered to it so far."""
        reply: Any = await self.redis.xreadgroup(keys.WORKER_GROUP, "w", {keys.requests_stream(self.model): ">"},
                                            count=1000)
        return [(entry_id, bus.decode_job(f[bus.JOB_FIELD]), fairshare.Ticket.from_fields(f))
                for _stream, entries in reply or () for entry_id, f in entries]

    async def finish(self, taken: list[tuple[bytes, bus.Job, fairshare.Ticket | None]],
                     completion_tokens: int = OUTPUT) -> None:
        """Ends jobs as a worker does: acknowledged and deleted, their charges settled, in one write."""
        pipe = self.redis.pipeline(transaction=False)
        settlements = []
        for entry_id, _job, ticket in taken:
            pipe.xack(keys.requests_stream(self.model), keys.WORKER_GROUP, entry_id)
            pipe.xdel(keys.requests_stream(self.model), entry_id)
            assert ticket is not None
            settlements.append(ticket.settle(PROMPT, completion_tokens, 1000.0))
        self.scheduler.settle(pipe, self.model, settlements)
        await pipe.execute()

    async def serve(self, jobs: int) -> list[str]:
        """Serves `jobs` jobs, one at a time; the tenants in the order they were served."""
        order: list[str] = []
        while len(order) < jobs:
            taken = await self.take()
            assert len(taken) == 1, taken
            order.append(taken[0][1].tenant)
            await self.finish(taken)
        return order

    async def serve_each(self, jobs: int) -> list[str]:
        """Serves `jobs` jobs, ending each as it is read (however many slots are free); the tenants in the order they
        were served."""
        order: list[str] = []
        while len(order) < jobs:
            taken = await self.take()
            assert taken, "nothing dispatched"
            order += [job.tenant for _entry, job, _ticket in taken]
            await self.finish(taken)
        return order[:jobs]

    async def state(self, name: str) -> int:
        return int(await self.redis.hget(keys.fair_key(self.model, "state"), name) or 0)


async def pool(redis: aioredis.Redis, slots: int, **settings: object) -> Pool:
    started = Pool(redis, fairshare.for_settings(redis, Settings(**settings)), slots)
    await started.start()
    return started


async def test_the_tenant_with_the_least_counter_goes_next(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=1)
    for _ in range(10):
        await fair.enqueue(make_job(fair.model, "a"))
        await fair.enqueue(make_job(fair.model, "b"))
    await fair.offer()
    assert await fair.serve(6) == ["a", "b"] * 3


async def test_charges_are_settled_with_the_tokens_really_generated(redis: aioredis.Redis) -> None:
    """a asks for ten times the tokens b asks for, but uses as many: settled, its jobs take turns with b's
    (charged by their estimates alone, b would go ten times in a row)."""
    fair = await pool(redis, slots=1)
    for _ in range(10):
        await fair.enqueue(make_job(fair.model, "a", output=10 * OUTPUT))
        await fair.enqueue(make_job(fair.model, "b"))
    await fair.offer()
    assert await fair.serve(8) == ["a", "b"] * 4


async def test_weights_1_to_2_give_service_1_to_2_within_10_percent(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=4)
    for _ in range(200):
        await fair.enqueue(make_job(fair.model, "light", weight=1))
        await fair.enqueue(make_job(fair.model, "heavy", weight=2))
    await fair.offer()
    served: Counter[str] = Counter()
    while sum(served.values()) < 240:  # both stay backlogged throughout
        taken = await fair.take()
        served.update(job.tenant for _entry, job, _ticket in taken)
        await fair.finish(taken)
    assert served["heavy"] / served["light"] == pytest.approx(2.0, rel=0.1), served


async def test_a_higher_priority_band_always_goes_first(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=1)
    for _ in range(5):  # the low band arrives first, and its tenant has never been served
        await fair.enqueue(make_job(fair.model, "low", priority=0))
    for _ in range(5):
        await fair.enqueue(make_job(fair.model, "high", priority=1))
        await fair.enqueue(make_job(fair.model, "top", priority=2))
    await fair.offer()
    assert await fair.serve(15) == ["top"] * 5 + ["high"] * 5 + ["low"] * 5


async def test_a_tenant_back_from_idle_gets_no_burst(redis: aioredis.Redis) -> None:
    """b is served a little, goes idle while a is served a lot, then comes back: they take turns at once, b's
    idle time is not saved up (without the lift b would get its next 20 jobs in a row)."""
    fair = await pool(redis, slots=1)
    await fair.offer()
    for _ in range(2):
        await fair.enqueue(make_job(fair.model, "b"))
    assert await fair.serve(2) == ["b", "b"]
    for _ in range(60):
        await fair.enqueue(make_job(fair.model, "a"))
    assert await fair.serve(30) == ["a"] * 30
    for _ in range(20):
        await fair.enqueue(make_job(fair.model, "b"))
    served = Counter(await fair.serve(20))
    assert served["b"] <= 11, served


async def test_a_refunded_reservation_does_not_put_a_tenant_back_from_idle_behind(redis: aioredis.Redis) -> None:
    """a's job reserves 100 times what it uses (a huge max_tokens, then it stops or hangs up); b comes in while it
    runs, and a stays backlogged while it is refunded: they then take turns. Lifted to a's reservation, b would sit
    ~100 jobs behind a, getting only the headroom while a floods, again after each such job of a's."""
    fair = await pool(redis, slots=2)
    await fair.offer()
    await fair.enqueue(make_job(fair.model, "a", output=100 * OUTPUT))
    await fair.enqueue(make_job(fair.model, "b"))
    big, b_job = await fair.take()
    await fair.finish([b_job])
    for _ in range(10):
        await fair.enqueue(make_job(fair.model, "a"))
    await fair.finish([big] + await fair.take(), completion_tokens=1)
    for _ in range(10):
        await fair.enqueue(make_job(fair.model, "b"))
    served = Counter(await fair.serve_each(10))
    assert served["b"] >= 4, served


async def test_a_job_that_finds_a_free_slot_and_no_backlog_is_charged_as_through_the_backlog(
        redis: aioredis.Redis) -> None:
    """With a slot free and nobody waiting, a job goes straight onto the request stream (there is no backlog entry
    to withdraw); its tenant's counter and its band's last-served mark end exactly where the way through the
    backlog (the same jobs queued first, then dispatched by an offer) leaves them."""
    straight, through = await pool(redis, slots=1), await pool(redis, slots=1)
    await straight.offer()
    for tenant, weight in (("a", 1.0), ("b", 2.0), ("a", 1.0)):
        admitted = await straight.enqueue(make_job(straight.model, tenant, weight=weight))
        assert isinstance(admitted, fairshare.Admitted) and (admitted.member, admitted.dispatched.sent) == (b"", 1)
        await through.offer(slots=0)  # no room: the job waits in its tenant's backlog until the offer below
        queued = await through.enqueue(make_job(through.model, tenant, weight=weight))
        assert isinstance(queued, fairshare.Admitted) and queued.member and queued.dispatched.sent == 0
        await through.offer()
        for pool_ in (straight, through):
            taken = await pool_.take()
            assert [job.tenant for _id, job, _ticket in taken] == [tenant]
            await pool_.finish(taken, completion_tokens=OUTPUT // 2)
    for name in ("counters", "state"):
        mine = await redis.hgetall(keys.fair_key(straight.model, name))
        theirs = await redis.hgetall(keys.fair_key(through.model, name))
        if name == "state":  # the backlog's sequence numbers its members; the straight way needs none
            theirs.pop(b"seq")
            mine.setdefault(b"queued", b"0")  # nothing was ever queued: the count is absent, read as 0
        assert mine == theirs and mine


async def test_a_tenant_alone_gets_every_slot(redis: aioredis.Redis) -> None:
    """Work conservation: as many jobs as the workers have slots are on their way at once, and each job that
    ends brings the next in the same write."""
    fair = await pool(redis, slots=8)
    for _ in range(20):
        await fair.enqueue(make_job(fair.model, "alone"))
    assert await fair.offer() == 8
    taken = await fair.take()
    assert len(taken) == 8
    await fair.finish(taken[:3])
    assert len(await fair.take()) == 3
    assert await fair.state("queued") == 9


async def test_a_withdrawn_job_leaves_its_backlog_and_its_counts(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=1)
    admitted = [await fair.enqueue(make_job(fair.model, "a")) for _ in range(3)]
    await fair.enqueue(make_job(fair.model, "b"))
    members = [a.member for a in admitted if isinstance(a, fairshare.Admitted)]
    for member in members:
        pipe = redis.pipeline(transaction=False)
        fair.scheduler.withdraw(pipe, fair.model, member)
        assert await pipe.execute() == [1]
    assert await fair.state("queued") == 1
    assert not await redis.hexists(keys.fair_key(fair.model, "queued"), "a")
    assert await redis.hlen(keys.fair_key(fair.model, "jobs")) == 1
    await fair.offer()
    assert await fair.serve(1) == ["b"]
    assert await fair.take() == []


async def test_an_expired_offer_takes_its_slots_away(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=4)
    await fair.offer(ttl_ms=100)
    deadline = time.monotonic() + 5
    while await redis.hlen(keys.fair_key(fair.model, "slots")):  # dropped by the first call after it expired
        assert time.monotonic() < deadline, "the expired offer stayed"
        await fair.scheduler.dispatch(fair.model)
    await fair.enqueue(make_job(fair.model, "a"))
    assert await redis.xlen(keys.requests_stream(fair.model)) == 0
    assert await fair.state("queued") == 1


async def test_the_model_bound_refuses_with_503_and_queues_nothing(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=0, max_queued_jobs=5)
    for i in range(5):
        assert isinstance(await fair.enqueue(make_job(fair.model, f"t{i}")), fairshare.Admitted)
    refused = await fair.enqueue(make_job(fair.model, "late"))
    assert isinstance(refused, QueueFull) and refused.status == 503 and refused.code == "queue_full"
    assert refused.retry_after_s and refused.retry_after_s >= 1
    assert await fair.state("queued") == 5
    assert await redis.zcard(keys.fair_key(fair.model, "backlog")) == 5
    assert not await redis.hexists(keys.fair_key(fair.model, "queued"), "late")


async def test_the_tenant_bound_refuses_with_429_and_spares_other_tenants(redis: aioredis.Redis) -> None:
    fair = await pool(redis, slots=0, max_queued_per_tenant=3)
    for _ in range(3):
        await fair.enqueue(make_job(fair.model, "greedy"))
    refused = await fair.enqueue(make_job(fair.model, "greedy"))
    assert isinstance(refused, TenantQueueFull) and refused.status == 429 and refused.code == "tenant_queue_full"
    assert isinstance(await fair.enqueue(make_job(fair.model, "modest")), fairshare.Admitted)
    assert await redis.hget(keys.fair_key(fair.model, "queued"), "greedy") == b"3"
    assert await fair.state("queued") == 4


async def test_the_bytes_a_tenant_holds_queued_are_bounded_and_given_back(redis: aioredis.Redis) -> None:
    """Redis memory is everyone's: a tenant's queued jobs may hold at most max_queued_bytes_per_tenant, and
    the bytes come back as its jobs are dispatched or withdrawn."""
    fair = await pool(redis, slots=0, max_queued_bytes_per_tenant=250_000)
    big = make_job(fair.model, "hoarder")
    big.messages = [bus.Message(role="user", content="x" * 100_000)]
    first = await fair.enqueue(big)
    assert isinstance(first, fairshare.Admitted)
    assert isinstance(await fair.enqueue(big), fairshare.Admitted)
    refused = await fair.enqueue(big)
    assert isinstance(refused, TenantQueueFull) and refused.code == "tenant_queue_full"
    assert isinstance(await fair.enqueue(make_job(fair.model, "hoarder")), fairshare.Admitted)  # small ones fit
    assert isinstance(await fair.enqueue(big), TenantQueueFull)
    assert isinstance(await fair.enqueue(make_job(fair.model, "modest")), fairshare.Admitted)
    pipe = redis.pipeline(transaction=False)
    fair.scheduler.withdraw(pipe, fair.model, first.member)
    await pipe.execute()
    assert isinstance(await fair.enqueue(big), fairshare.Admitted)  # the withdrawn job's bytes came back
    await fair.offer(10)
    await fair.finish(await fair.take())
    assert await redis.hget(keys.fair_key(fair.model, "queued"), "hoarder\0bytes") is None  # all dispatched


async def test_a_wait_longer_than_the_deadline_is_refused(redis: aioredis.Redis) -> None:
    """One slot, jobs lasting 1 s on average (as the settled jobs said), 5 queued: a job with 2 s left cannot
    start in time, one with a minute can; a tenant with nothing queued skips most of the queue."""
    fair = await pool(redis, slots=1)
    await fair.offer()
    for _ in range(6):
        await fair.enqueue(make_job(fair.model, "a"))
    await fair.finish(await fair.take())  # took 1 s: the average
    assert await fair.state("queued") == 4
    refused = await fair.enqueue(make_job(fair.model, "a", deadline_s=2))
    assert isinstance(refused, WaitExceedsDeadline) and refused.status == 503
    assert refused.code == "wait_exceeds_deadline" and refused.retry_after_s in (3, 4)  # 5 s wait, 2 s left
    assert await fair.state("queued") == 4
    assert isinstance(await fair.enqueue(make_job(fair.model, "a", deadline_s=60)), fairshare.Admitted)
    assert isinstance(await fair.enqueue(make_job(fair.model, "b", deadline_s=3)), fairshare.Admitted)


async def test_fifo_keeps_one_queue_with_the_model_bound(redis: aioredis.Redis) -> None:
    fifo = await pool(redis, slots=2, scheduler="fifo", max_queued_jobs=3)
    await fifo.offer()
    for _ in range(3):
        assert isinstance(await fifo.enqueue(make_job(fifo.model, "a")), fairshare.Admitted)
    assert len(await fifo.take()) == 3  # delivered jobs are no longer queued
    for tenant in ("b", "c", "c"):
        assert isinstance(await fifo.enqueue(make_job(fifo.model, tenant)), fairshare.Admitted)
    refused = await fifo.enqueue(make_job(fifo.model, "d"))
    assert isinstance(refused, QueueFull)
    assert [job.tenant for _e, job, _t in await fifo.take()] == ["b", "c", "c"]


def wide_job(model: str, tenant: str, sequences: int) -> bus.Job:
    """A completion of one prompt with `sequences` choices."""
    job = make_job(model, tenant)
    job.kind, job.prompts, job.params = "completion", ["count"], bus.SamplingParams(n=sequences)
    return job


async def test_a_job_takes_as_many_slots_as_it_has_sequences(redis: aioredis.Redis) -> None:
    """8 slots hold two jobs of 3 choices, not eight: the third waits for one of them to end."""
    fair = await pool(redis, slots=8)
    for _ in range(3):
        await fair.enqueue(wide_job(fair.model, "a", 3))
    assert await fair.offer() == 2
    taken = await fair.take()
    assert [job.sequences() for _id, job, _ticket in taken] == [3, 3]
    assert [ticket.sequences for _id, _job, ticket in taken if ticket] == [3, 3]
    await fair.finish(taken[:1])
    assert len(await fair.take()) == 1


async def test_a_wide_job_is_not_overtaken_by_narrow_ones(redis: aioredis.Redis) -> None:
    """A job of 4 sequences, next in turn behind 4 running narrow jobs, gets the 4 slots once they free although
    narrow jobs wait too: each slot that frees waits for it rather than going to a narrow job (it would never
    have 4)."""
    fair = await pool(redis, slots=4)
    for _ in range(10):
        await fair.enqueue(make_job(fair.model, "narrow"))
    await fair.offer()
    running = await fair.take()
    await fair.enqueue(wide_job(fair.model, "wide", 4))
    for one in running[:-1]:
        await fair.finish([one])
        assert await fair.take() == []
    await fair.finish(running[-1:])
    assert [job.tenant for _id, job, _ticket in await fair.take()] == ["wide"]


async def test_the_wait_estimate_counts_sequences(redis: aioredis.Redis) -> None:
    """A job behind wide ones is refused for a deadline that the same number of narrow jobs would let it meet."""
    narrow, wide = await pool(redis, slots=2), await pool(redis, slots=2)
    for fair, sequences in ((narrow, 1), (wide, 2)):
        await fair.offer(slots=0)
        for _ in range(4):
            await fair.enqueue(wide_job(fair.model, "a", sequences))
        await fair.redis.hset(keys.fair_key(fair.model, "state"), "avg_ms", "1000")  # a job runs 1 s
        await fair.offer()  # two slots: 2 narrow jobs (or 1 wide) leave, the others wait
    # narrow: 2 jobs ahead, one slot frees each 500 ms: ~1.5 s; wide: 3 jobs of 2 ahead: ~3.5 s
    assert isinstance(await narrow.enqueue(make_job(narrow.model, "a", deadline_s=2.5)), fairshare.Admitted)
    assert isinstance(await wide.enqueue(make_job(wide.model, "a", deadline_s=2.5)), WaitExceedsDeadline)


async def test_a_tenant_holding_the_headroom_s_worth_leaves_it_to_one_that_comes_in(redis: aioredis.Redis) -> None:
    """A worker of 8 slots keeping 2 as headroom: a flooding tenant gets 6 of them; a tenant that comes in while it
    floods gets a slot at once, in the enqueue's own dispatch; the flood's ending jobs make room for more of its own,
    up to the headroom: two slots stay free for the next tenant to come."""
    fair = await pool(redis, slots=8)
    await fair.scheduler.dispatch(fair.model, fairshare.Offer("w", 8, 60_000, headroom=2))
    for _ in range(20):
        await fair.enqueue(make_job(fair.model, "flood"))
    flooding = await fair.take()
    assert len(flooding) == 6
    admitted = await fair.enqueue(make_job(fair.model, "newcomer"))
    assert isinstance(admitted, fairshare.Admitted) and admitted.dispatched.sent == 1
    assert [job.tenant for _id, job, _ticket in await fair.take()] == ["newcomer"]
    await fair.finish(flooding[:3])
    assert [job.tenant for _id, job, _ticket in await fair.take()] == ["flood"] * 2
