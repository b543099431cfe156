"""Raw pipelines against a real Redis: replies in order with errors in their place, and the connection either
held for good (the publisher's) or given back to the pool after each call (the housekeeping loops')."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ResponseError

from shared.redisio import clients as redis_clients
from shared.redisio import rawpipe


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


async def test_a_listener_takes_every_message_including_those_read_before_it_took_over(redis_url: str) -> None:
    """Messages that reached the stream reader before the listener took the connection over (more than one read
    of it holds) are handed to it, whole and in order, then each later read in the callback that brings it; the
    connection's end ends the listening."""
    reader_client = redis_clients.dedicated(redis_url, "test-listener")
    publisher = redis_clients.pooled(redis_url, "test-listener-publisher", 1)
    channel = f"test-listener-{uuid.uuid4().hex}"
    connection = await reader_client.connection_pool.get_connection()
    got: list[bytes] = []
    all_in = asyncio.Event()
    try:
        await connection.send_packed_command(rawpipe.pack(("CLIENT", "ID")), check_health=False)
        client_id = (await rawpipe.read_replies(connection, 1))[0]
        await connection.send_packed_command(rawpipe.pack(("SSUBSCRIBE", channel)), check_health=False)
        reader = connection._parser._reader
        while (confirmed := reader.gets()) is rawpipe.NOT_ENOUGH_DATA:  # a push, not a reply, in RESP3
            await connection._parser.read_from_socket()
        assert confirmed[0] == b"ssubscribe"
        early = [b"%d:" % i + b"x" * 4096 for i in range(40)]  # 160 KiB: more than a read of 64 KiB
        for message in early:
            await publisher.execute_command("SPUBLISH", channel, message)
        await asyncio.sleep(0.2)  # all of it in the stream reader's buffer
        await connection._parser.read_from_socket()  # the parser takes one read of it

        def take() -> None:
            while (reply := listener.reader.gets()) is not rawpipe.NOT_ENOUGH_DATA:
                got.append(reply[2])
            if len(got) == len(early) + 1:
                all_in.set()

        listener = rawpipe.Listener(connection, take)
        take()  # what the parser held already
        assert not listener.ended.done()
        await publisher.execute_command("SPUBLISH", channel, b"late")
        async with asyncio.timeout(5):
            await all_in.wait()
        await publisher.execute_command("CLIENT", "KILL", "ID", client_id)
        async with asyncio.timeout(5):
            ended = await listener.ended
    finally:
        await connection.disconnect()
        await reader_client.aclose()
        await publisher.aclose()
    assert got == [*early, b"late"]
    assert "lost" in str(ended)



async def test_a_span_takes_the_replies_of_the_commands_added_within_it(redis_url: str) -> None:
    """Groups of commands in one write, an empty one among them, each read back by its span."""
    client = redis_clients.pooled(redis_url, "test-rawpipe", 2)
    key = f"test-rawpipe-{uuid.uuid4().hex}"
    try:
        pipe = rawpipe.Pipelines(client).pipeline()
        with rawpipe.Span(pipe) as first:
            pipe.execute_command("SET", key, "1")
            pipe.execute_command("INCR", key)
        with rawpipe.Span(pipe) as empty:
            pass
        with rawpipe.Span(pipe) as last:
            pipe.execute_command("GET", key)
        replies = await pipe.execute()
        await client.delete(key)
    finally:
        await client.aclose()
    assert (first.of(replies), empty.of(replies), last.of(replies)) == ([b"OK", 2], [], [b"2"])
