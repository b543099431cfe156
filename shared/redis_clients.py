"""Every Redis client tokenbus opens, made in one place: bounded pools, named connections."""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

CHECKOUT_TIMEOUT_S = 30.0
"""How long a caller waits for a free connection of a full pool."""
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
"""Longer than any blocking read made on a pooled connection (those block for a second)."""


def _reconnect_once() -> Retry:
    """A command whose connection turns out dead (it died idle, as when Redis restarts) runs once more on a
    fresh one, at once: else the first request after a restart fails. A timeout is not retried (the command
    may still run), nor is a second connection failure (Redis is down: callers fail fast)."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def pooled(url: str, name: str, size: int, cluster: bool = False) -> aioredis.Redis:
    """A client over at most `size` connections (per node of a cluster); every command is bounded by
    redis-py's socket timeout. A cluster client has the same commands, routed by key."""
    if cluster:
        return _cluster(url, name, size, COMMAND_TIMEOUT_S)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(  # closing the client closes the pool
        url, max_connections=size, timeout=CHECKOUT_TIMEOUT_S, client_name=name, retry=_reconnect_once(),
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S))


def dedicated(url: str, name: str, cluster: bool = False) -> aioredis.Redis:
    """A client over one connection for a single hot loop, with no socket timeout: redis-py bounds each
    command's write with asyncio.wait_for, a task per command, which showed in the edge's profile. The loop
    bounds every call itself with asyncio.timeout instead."""
    if cluster:
        return _cluster(url, name, 1, None)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=1, timeout=CHECKOUT_TIMEOUT_S, client_name=name, socket_timeout=None,
        retry=_reconnect_once(), socket_connect_timeout=CONNECT_TIMEOUT_S))


def _cluster(url: str, name: str, size: int, timeout_s: float | None) -> aioredis.Redis:
    """A Redis Cluster client: the same commands as a plain client (multi-key ones in one hash slot), so the
    callers treat it as one. redis-py's cluster pools cannot wait for a free connection (a full one fails
    the command), so a node gets the connections its callers need: `size` is not a bound there."""
    del size
    return cast(aioredis.Redis, RedisCluster.from_url(
        url, client_name=name, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=timeout_s))


async def subscriber(client: aioredis.Redis) -> PubSub:
    """A pub/sub of the client that skips subscribe confirmations; a cluster client reads the cluster's slot
    map first (its pub/sub needs it; a plain client connects on demand)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
    return client.pubsub(ignore_subscribe_messages=True)
