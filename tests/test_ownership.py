"""A stopping worker hands its running jobs over against a real Redis: only those whose entries are still its own."""

from __future__ import annotations

import uuid
from typing import Any

import redis
import redis.asyncio as aioredis

from services.worker.jobtable import Run
from services.worker.ownership import Ownership
from shared.protocol import bus, keys
from shared.redisio import clients as redis_clients


def _read(redis_client: redis.Redis, stream: str, consumer: str) -> tuple[bytes, bus.Job]:
    """A job queued on `stream` and read by `consumer`: its entry id and the job."""
    job = bus.Job(id=f"job-{uuid.uuid4().hex}", model="m", reply_to="edge", deadline_ms=0)
    redis_client.xadd(stream, {bus.JOB_FIELD: bus.encode_job(job)})
    reply: Any = redis_client.xreadgroup(keys.WORKER_GROUP, consumer, {stream: ">"})
    [[_stream, [(entry_id, _fields)]]] = reply
    return bytes(entry_id), job


async def test_a_job_another_worker_claimed_meanwhile_is_not_handed_over_again(
        redis_url: str, redis_client: redis.Redis) -> None:
    """A stopping worker whose hand-over came late (its drain was slow, and the entry went idle past the claim
    time) finds its job claimed by another worker, which continues it: handing it over as well would give the job
    two owners, whose logs conflict and whose client gets an error. It is left to the claimer; a job still its
    own is handed over."""
    model = f"model-{uuid.uuid4().hex}"
    stream = keys.requests_stream(model)
    client: aioredis.Redis = redis_clients.dedicated(redis_url, "test-ownership")
    stopping = Ownership(client, "stopping", model, stream, keys.WORKER_GROUP)
    redis_client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    try:
        claimed_id, claimed_job = _read(redis_client, stream, "stopping")
        kept_id, kept_job = _read(redis_client, stream, "stopping")
        redis_client.xclaim(stream, keys.WORKER_GROUP, "claimer", 0, [claimed_id])
        assert await stopping.hand_over(Run(claimed_job, claimed_id)) is None
        assert await stopping.hand_over(Run(kept_job, kept_id)) is not None
        pending = redis_client.xpending_range(stream, keys.WORKER_GROUP, "-", "+", 10)
        assert [(p["message_id"], p["consumer"]) for p in pending] == [(claimed_id, b"claimer")]
        queued = [bus.decode_job(fields[bus.JOB_FIELD]).id
                  for _id, fields in redis_client.xrange(stream) if _id not in (claimed_id, kept_id)]
        assert queued == [kept_job.id]  # the one handed over, queued again; the claimed one not
    finally:
        await client.aclose()
