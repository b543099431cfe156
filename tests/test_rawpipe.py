"""Raw pipelines against a real Redis: replies in order with errors in their place, and the connection either
held for good (the publisher's) or given back to the pool after each call (the housekeeping loops')."""

from __future__ import annotations

import uuid

import pytest
from redis.exceptions import ResponseError

from shared import rawpipe, redis_clients


@pytest.mark.parametrize("keep", [True, False])
async def test_replies_come_back_in_order_and_the_connection_is_kept_or_given_back(redis_url: str, keep: bool) -> None:
    client = redis_clients.pooled(redis_url, "test-rawpipe", 2)
    pipelines = rawpipe.Pipelines(client, keep=keep)
    key = f"test-rawpipe-{uuid.uuid4().hex}"
    try:
        for _ in range(3):
            pipe = pipelines.pipeline()
            pipe.execute_command("ZADD", key, 1.5, "a")
            pipe.execute_command("HGET", key, "x")  # a zset is not a hash: an error, in its place
            pipe.execute_command("ZRANGE", key, 0, -1)
            replies = await pipe.execute(raise_on_error=False)
            in_use = len(client.connection_pool._in_use_connections)
        await client.delete(key)
    finally:
        await client.aclose()
    assert replies[0] == 0 and replies[2] == [b"a"]
    assert isinstance(replies[1], ResponseError) and "WRONGTYPE" in str(replies[1])
    assert in_use == (1 if keep else 0)
