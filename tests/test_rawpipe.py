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


async def test_replies_larger_than_one_socket_read_all_come_back(redis_url: str) -> None:
    client = redis_clients.pooled(redis_url, "test-rawpipe", 2)
    pipelines = rawpipe.Pipelines(client)
    key = f"test-rawpipe-{uuid.uuid4().hex}"
    value = uuid.uuid4().hex.encode() * 128  # 4 KiB: 300 replies are ~19 socket reads of 64 KiB
    try:
        await client.set(key, value)
        pipe = pipelines.pipeline()
        for i in range(300):
            pipe.execute_command("GET", key)
            if i % 100 == 0:
                pipe.execute_command("HGET", key, "x")
        replies = await pipe.execute(raise_on_error=False)
        await client.delete(key)
    finally:
        await client.aclose()
    errors = [i for i, reply in enumerate(replies) if isinstance(reply, ResponseError)]
    assert errors == [1, 102, 203] and len(replies) == 303
    assert all(reply == value for i, reply in enumerate(replies) if i not in errors)


async def test_a_held_connection_that_redis_closed_is_replaced_on_the_next_call(redis_url: str) -> None:
    client = redis_clients.pooled(redis_url, "test-rawpipe", 2)
    pipelines = rawpipe.Pipelines(client)
    try:
        pipe = pipelines.pipeline()
        pipe.execute_command("CLIENT", "ID")
        [held_id] = await pipe.execute()
        assert await client.client_kill_filter(_id=held_id) == 1
        pipe = pipelines.pipeline()
        pipe.execute_command("CLIENT", "ID")
        pipe.execute_command("PING")
        replies = await pipe.execute()
    finally:
        await client.aclose()
    assert replies[0] != held_id and replies[1] in (True, b"PONG")
