"""Every Redis client tokenbus opens, made in one place: bounded pools, named connections."""

from __future__ import annotations

import redis.asyncio as aioredis

CHECKOUT_TIMEOUT_S = 30.0
"""How long a caller waits for a free connection of a full pool."""
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
"""Longer than any blocking read made on a pooled connection (those block for a second)."""


def pooled(url: str, name: str, size: int) -> aioredis.Redis:
    """A client over at most `size` connections; every command is bounded by redis-py's socket timeout."""
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(  # closing the client closes the pool
        url, max_connections=size, timeout=CHECKOUT_TIMEOUT_S, client_name=name,
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S))


def dedicated(url: str, name: str) -> aioredis.Redis:
    """A client over one connection for a single hot loop, with no socket timeout: redis-py bounds each
    command's write with asyncio.wait_for, a task per command, which showed in the edge's profile. The loop
    bounds every call itself with asyncio.timeout instead."""
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=1, timeout=CHECKOUT_TIMEOUT_S, client_name=name, socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S))
