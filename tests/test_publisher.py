"""The worker's event publisher against a real Redis: acknowledgements and what must follow them (the scheduler's
settlement) leave in one write, and a failing follow-up never holds the events back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from services.worker.publisher import EventPublisher
from shared import bus, keys, redis_clients
from shared.rawpipe import PipelineLike
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
