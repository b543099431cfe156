"""Every Redis client tokenbus opens, made in one place: bounded pools, named connections."""

from __future__ import annotations

from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


class AccessSettings(Protocol):
    """How a process logs in to Redis (Settings has it)."""

    @property
    def redis_password_file(self) -> str: ...
    @property
    def redis_tls_ca_file(self) -> str: ...
    @property
    def redis_tls_cert_file(self) -> str: ...
    @property
    def redis_tls_key_file(self) -> str: ...
    @property
    def redis_username(self) -> str: ...


CHECKOUT_TIMEOUT_S = 30.0
"""How long a caller waits for a free connection of a full pool."""
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
"""Longer than any blocking read made on a pooled connection (those block for a second)."""


class Access(msgspec.Struct, frozen=True, kw_only=True):
    """How a client logs in to Redis besides its URL: an ACL user whose password is read from a file (a
    mounted secret), so that it is in no URL, environment variable or log; and for a `rediss://` URL, the CA
    that signed Redis's certificate and the client's own certificate, if Redis asks for one. A URL's own user,
    password or `ssl_*` parameters win over these (redis-py's rule)."""

    username: str = ""
    password_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""


NO_ACCESS = Access()


def access_of(settings: AccessSettings) -> Access:
    """The Access its --redis-* settings give a process."""
    return Access(username=settings.redis_username, password_file=settings.redis_password_file,
                  tls_ca_file=settings.redis_tls_ca_file, tls_cert_file=settings.redis_tls_cert_file,
                  tls_key_file=settings.redis_tls_key_file)


def read_password(path: str) -> str:
    """A password file's content, without the line end that `echo` and editors leave."""
    with open(path, encoding="utf-8") as file:
        return file.read().rstrip("\r\n")


def login(url: str, access: Access) -> dict[str, Any]:
    """redis-py's connection arguments for `access` (none for an empty one)."""
    options: dict[str, Any] = {}
    if access.username:
        options["username"] = access.username
    if access.password_file:
        options["password"] = read_password(access.password_file)
    if urlsplit(url).scheme == "rediss":  # a plain connection takes no ssl_* arguments
        for name, path in (("ssl_ca_certs", access.tls_ca_file), ("ssl_certfile", access.tls_cert_file),
                           ("ssl_keyfile", access.tls_key_file)):
            if path:
                options[name] = path
    return options


def _reconnect_once() -> Retry:
    """A command whose connection turns out dead (it died idle, as when Redis restarts) runs once more on a
    fresh one, at once: else the first request after a restart fails. A timeout is not retried (the command
    may still run), nor is a second connection failure (Redis is down: callers fail fast)."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def pooled(url: str, name: str, size: int, cluster: bool = False, access: Access = NO_ACCESS) -> aioredis.Redis:
    """A client over at most `size` connections (per node of a cluster); every command is bounded by
    redis-py's socket timeout. A cluster client has the same commands, routed by key."""
    if cluster:
        return _cluster(url, name, size, COMMAND_TIMEOUT_S, access)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(  # closing the client closes the pool
        url, max_connections=size, timeout=CHECKOUT_TIMEOUT_S, client_name=name, retry=_reconnect_once(),
        socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S, **login(url, access)))


def dedicated(url: str, name: str, cluster: bool = False, access: Access = NO_ACCESS) -> aioredis.Redis:
    """A client over one connection for a single hot loop, with no socket timeout: redis-py bounds each
    command's write with asyncio.wait_for, a task per command, which showed in the edge's profile. The loop
    bounds every call itself with asyncio.timeout instead."""
    if cluster:
        return _cluster(url, name, 1, None, access)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
        url, max_connections=1, timeout=CHECKOUT_TIMEOUT_S, client_name=name, socket_timeout=None,
        retry=_reconnect_once(), socket_connect_timeout=CONNECT_TIMEOUT_S, **login(url, access)))


def _cluster(url: str, name: str, size: int, timeout_s: float | None, access: Access) -> aioredis.Redis:
    """A Redis Cluster client: the same commands as a plain client (multi-key ones in one hash slot), so the
    callers treat it as one. redis-py's cluster pools cannot wait for a free connection (a full one fails
    the command), so a node gets the connections its callers need: `size` is not a bound there."""
    del size
    return cast(aioredis.Redis, RedisCluster.from_url(
        url, client_name=name, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=timeout_s,
        **login(url, access)))


async def subscriber(client: aioredis.Redis) -> PubSub:
    """A pub/sub of the client that skips subscribe confirmations; a cluster client reads the cluster's slot
    map first (its pub/sub needs it; a plain client connects on demand)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
    return client.pubsub(ignore_subscribe_messages=True)
