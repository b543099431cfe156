"""The worker's event publisher against a real Redis: acknowledgements and what must follow them (the scheduler's
settlement) leave in one write, and a failing follow-up never holds the events back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from services.worker import publisher as publisher_module
from services.worker.publisher import EventPublisher
from shared.protocol import bus, joblog, keys
from shared.protocol.sequence import in_order
from shared.redisio import clients as redis_clients
from shared.redisio.rawpipe import PipelineLike
from tests.channel import listening
from tests.test_enqueue import counting_writes


class Followup:
    """Records what the publisher hands it; its command is a SET, or a script Redis does not know."""

    def __init__(self, key: str, fail: bool = False) -> None:
        self.key = key
        self.fail = fail
        self.notes: list[Any] = []
        self.results: list[Any] = []

    def queue(self, pipe: PipelineLike, notes: list[Any]) -> None:
        self.notes += notes
        if self.fail:
            pipe.execute_command("EVALSHA", "0" * 40, 0)
        else:
            pipe.execute_command("SET", self.key, len(notes))

    def done(self, results: list[Any]) -> None:
        self.results += results


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    opened = redis_clients.dedicated(redis_url, "test-publisher")
    yield opened
    await opened.aclose()


async def queued_entry(redis_client: redis.Redis, stream: str) -> bytes:
    redis_client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    entry_id = redis_client.xadd(stream, {bus.JOB_FIELD: b"job"})
    redis_client.xreadgroup(keys.WORKER_GROUP, "w", {stream: ">"})
    return bytes(entry_id)


@pytest.mark.parametrize("fail", [False, True])
async def test_acknowledgements_and_their_followup_leave_in_one_write(
        client: aioredis.Redis, redis_client: redis.Redis, fail: bool) -> None:
    stream, events, job = f"jobs-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}", f"job-{uuid.uuid4().hex}"
    entry_id = await queued_entry(redis_client, stream)
    followup = Followup(f"followup-{uuid.uuid4().hex}", fail=fail)
    publisher = EventPublisher(client, 100, after_acks=followup)
    writes = counting_writes(publisher.pipelines)
    with listening(redis_client, events) as edge:
        publisher.publish(events, bus.Final(job=job, prompt_tokens=1, completion_tokens=1))
        publisher.ack_after(stream, keys.WORKER_GROUP, entry_id, note="settle j")
        publisher.ack_after(stream, keys.WORKER_GROUP, entry_id)  # no note: nothing to settle
        await publisher.flush()
        assert [type(e) for _t, e in edge.events(wait_s=2)] == [bus.Final]
    assert writes == [1]  # a failed follow-up is not retried with the events
    assert followup.notes == ["settle j"]
    assert redis_client.xlen(keys.job_log(job)) == 1 and redis_client.xlen(stream) == 0
    assert len(followup.results) == 1
    if fail:
        assert isinstance(followup.results[0], redis.exceptions.NoScriptError)
    else:
        assert redis_client.get(followup.key) == b"1"


async def test_a_write_without_acknowledgements_has_no_followup(
        client: aioredis.Redis, redis_client: redis.Redis) -> None:
    followup = Followup(f"followup-{uuid.uuid4().hex}")
    publisher = EventPublisher(client, 100, after_acks=followup)
    publisher.publish(f"events-{uuid.uuid4().hex}", bus.Final(job="j", prompt_tokens=1, completion_tokens=1))
    await publisher.flush()
    assert followup.results == [] and not redis_client.exists(followup.key)


async def test_lookups_ride_the_events_write_and_get_their_replies_together(
        client: aioredis.Redis, redis_client: redis.Redis) -> None:
    """A fresh batch's cancel-and-resume check goes in the write that carries its first events: one round trip,
    its replies in order, an error reply in its place."""
    job, events = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    redis_client.set(keys.job_reply_to(job), "elsewhere", ex=60)
    redis_client.set(f"list-{job}", "not a list", ex=60)
    publisher = EventPublisher(client, 100)
    writes = counting_writes(publisher.pipelines)
    got: list[list[Any]] = []
    with listening(redis_client, events) as edge:
        publisher.publish(events, bus.Started(job=job, epoch=1, worker="w"))
        publisher.then([("EXISTS", keys.cancelled(job)), ("GET", keys.job_reply_to(job)), ("LLEN", f"list-{job}")],
                       got.append)
        await publisher.flush()
        assert [type(e) for _t, e in edge.events(wait_s=0.5)] == [bus.Started]
    assert writes == [1]
    assert len(got) == 1 and got[0][:2] == [0, b"elsewhere"]
    assert isinstance(got[0][2], redis.exceptions.ResponseError)  # WRONGTYPE, in its place


def _tokens(job: str, start: int, count: int) -> list[bus.Event]:
    return [bus.Tokens(job=job, text=str(i), token_ids=[i], seq=i) for i in range(start, start + count)]


def _positions(redis_client: redis.Redis, job: str) -> list[int]:
    """The positions a worker taking the job over (or a resumed stream) takes from its log."""
    taken, conflict = in_order(joblog.parse(redis_client.xrange(keys.job_log(job))))
    assert not conflict
    return [event.seq for event in taken]


async def test_token_writes_leave_their_replies_unread_for_a_while(
        client: aioredis.Redis, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write of tokens alone does not wait for its replies (that wait costs the worker a wake per token); once
    the tokens stop they are read within CONFIRM_QUIET_S, and the events are written all the same."""
    monkeypatch.setattr(publisher_module, "CONFIRM_QUIET_S", 0.3)
    job, channel = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    publisher = EventPublisher(client, 100)
    running = asyncio.create_task(publisher.run())
    try:
        with listening(redis_client, channel) as edge:
            for event in _tokens(job, 0, 3):
                publisher.publish(channel, event)
                await asyncio.sleep(0.02)
            assert [e.seq for _t, e in await asyncio.to_thread(edge.events, 0.2)] == [0, 1, 2]
        assert publisher.pipelines.held is not None and publisher.pipelines.held.unread > 0
        await asyncio.wait_for(publisher.idle.wait(), 2)
        assert publisher.pipelines.held.unread == 0 and not publisher.unconfirmed
        assert _positions(redis_client, job) == [0, 1, 2]
    finally:
        running.cancel()


async def test_a_drain_reads_the_replies_left_unread_at_once(
        client: aioredis.Redis, redis_client: redis.Redis) -> None:
    """A worker handing its jobs over drains its publisher: the replies its token writes left unread are read then,
    not seconds later when the quiet check comes (CONFIRM_QUIET_S as shipped)."""
    job, channel = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    publisher = EventPublisher(client, 100)
    running = asyncio.create_task(publisher.run())
    try:
        for event in _tokens(job, 0, 3):
            publisher.publish(channel, event)
            await asyncio.sleep(0.02)
        assert publisher.pipelines.held is not None and publisher.pipelines.held.unread > 0
        started = asyncio.get_running_loop().time()
        await publisher.drain(timeout_s=publisher_module.CONFIRM_QUIET_S)
        assert asyncio.get_running_loop().time() - started < publisher_module.CONFIRM_QUIET_S / 2
        assert publisher.pipelines.held.unread == 0 and not publisher.unconfirmed
        assert _positions(redis_client, job) == [0, 1, 2]
    finally:
        running.cancel()


async def test_while_tokens_flow_their_replies_are_read_by_the_next_write_not_by_a_wake_of_their_own(
        client: aioredis.Redis, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens every 20 ms for 0.6 s: no write waits for its own replies, none of the publisher's wakes is a
    timer's, and the replies are read once they are CONFIRM_AFTER_S old, by the token write that follows."""
    monkeypatch.setattr(publisher_module, "CONFIRM_AFTER_S", 0.1)
    job, channel = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    publisher = EventPublisher(client, 100)
    confirmed = counting_writes(publisher.pipelines)
    held = publisher.pipelines.held
    assert held is not None
    reads, most_unconfirmed, timer_flushes = [0], [0], [0]
    read_unread, flush = held.read_unread, publisher._flush

    async def counted_read() -> list[Any]:
        reads[0] += 1
        return await read_unread()

    async def watched_flush(confirm: bool) -> None:
        timer_flushes[0] += confirm
        await flush(confirm)
        most_unconfirmed[0] = max(most_unconfirmed[0], len(publisher.unconfirmed))

    monkeypatch.setattr(held, "read_unread", counted_read)
    monkeypatch.setattr(publisher, "_flush", watched_flush)
    running = asyncio.create_task(publisher.run())
    try:
        for event in _tokens(job, 0, 30):
            publisher.publish(channel, event)
            await asyncio.sleep(0.02)
        assert confirmed == [0] and timer_flushes == [0]
        assert reads[0] >= 3  # about every fifth write read the replies of those before it
        assert most_unconfirmed[0] <= 8
    finally:
        running.cancel()
    assert _positions(redis_client, job) == list(range(30))


async def test_a_token_write_whose_unread_replies_show_a_failure_is_written_again(
        client: aioredis.Redis, redis_client: redis.Redis) -> None:
    """Its tokens land in the log after a later write's, yet a reader of the log takes every position in order
    (a worker taking the job over, a resumed stream)."""
    job, channel = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    redis_client.set(keys.job_log(job), "not a stream")  # its XADD fails: WRONGTYPE, in a reply nobody reads yet
    publisher = EventPublisher(client, 100)
    for event in _tokens(job, 0, 2):
        publisher.publish(channel, event)
    await publisher._flush(confirm=False)
    assert len(publisher.unconfirmed) == 1
    redis_client.delete(keys.job_log(job))  # the fault passes: the next write lands first
    for event in _tokens(job, 2, 2):
        publisher.publish(channel, event)
    await publisher._flush(confirm=False)
    await publisher.flush()
    assert _positions(redis_client, job) == [0, 1, 2, 3]


async def test_token_writes_on_a_connection_lost_before_their_replies_are_written_again(
        client: aioredis.Redis, redis_client: redis.Redis) -> None:
    """Redis drops the worker's connection with two token writes in it, unrun (writes were paused): they are
    written again once the loss shows, before what follows."""
    job, channel = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    publisher = EventPublisher(client, 100)
    await publisher.flush()  # connects
    redis_client.client_pause(5000, all=False)  # writes wait, unrun, in the connection's input
    try:
        for start in (0, 2):
            for event in _tokens(job, start, 2):
                publisher.publish(channel, event)
            await publisher._flush(confirm=False)
        assert len(publisher.unconfirmed) == 2
        ids = [c["id"] for c in redis_client.client_list() if c["name"] == "test-publisher"]
        assert sum(redis_client.client_kill_filter(_id=i) for i in ids) >= 1
    finally:
        redis_client.client_unpause()
    assert redis_client.xlen(keys.job_log(job)) == 0  # they never ran
    for event in _tokens(job, 4, 1):
        publisher.publish(channel, event)
    await publisher.flush()
    assert _positions(redis_client, job) == [0, 1, 2, 3, 4]


async def test_tokens_published_while_a_write_is_retried_go_out_after_it(
        client: aioredis.Redis, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that must be confirmed fails (its log's key has the wrong type) and waits to be retried; the tokens
    published meanwhile, which could go out at once on the same connection, wait for it: the edge gets every
    position in order."""
    monkeypatch.setattr(publisher_module, "RETRY_PAUSE_S", 0.3)
    job, channel = f"job-{uuid.uuid4().hex}", f"events-{uuid.uuid4().hex}"
    redis_client.set(keys.job_log(job), "not a stream")
    publisher = EventPublisher(client, 100)
    running = asyncio.create_task(publisher.run())
    try:
        with listening(redis_client, channel) as edge:
            publisher.publish(channel, bus.Started(job=job, worker="w", seq=0))
            publisher.then([("EXISTS", keys.cancelled(job))], lambda replies: None)
            await asyncio.sleep(0.1)  # its first try failed: it waits to be tried again
            assert publisher.writing
            for event in _tokens(job, 1, 2):
                publisher.publish(channel, event)
            await asyncio.sleep(0.05)
            redis_client.delete(keys.job_log(job))  # the fault passes
            seqs = [e.seq for _t, e in await asyncio.to_thread(edge.events, 1.0)]
        await asyncio.wait_for(publisher.idle.wait(), 3)
    finally:
        running.cancel()
    assert seqs == sorted(seqs) and seqs[-2:] == [1, 2]
    assert _positions(redis_client, job) == [0, 1, 2]
