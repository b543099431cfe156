"""Who is calling: the API key a request presents, checked against Redis through a short-lived cache that
every key change (update, revoke) clears on every edge at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web

from services.edge.redis_boundary import REDIS_FAILURES
from shared.protocol import keys
from shared.protocol.errors import ModelNotFound, Unauthenticated
from shared.redisio import clients as redis_clients
from shared.runtime.background import looping
from shared.tenancy import apikeys
from shared.tenancy.apikeys import KeyRecord

log = logging.getLogger(__name__)

KEY_HEADERS = ("api-key", "x-api-key")
"""Besides `Authorization: Bearer`: the headers Azure-style and Databricks/OVMS clients send a key in."""
RESUBSCRIBE_PAUSE_S = 0.5


@dataclass(frozen=True)
class Caller:
    """The tenant behind a request, and its key (None when the edge serves without keys)."""

    tenant: str
    key: KeyRecord | None = None

    @property
    def key_id(self) -> str:
        return self.key.id if self.key else "-"

    @property
    def sees(self) -> str | None:
        """The tenant whose private adapters the caller may see; None: every adapter (an edge without keys)."""
        return None if self.key is None else self.tenant

    def check_model(self, model: str, param: str = "model") -> None:
        """A model the key may not use is a 404, as if it did not exist: nothing about it is revealed."""
        if self.key is not None and not self.key.may_use(model):
            raise ModelNotFound(f"The {'adapter' if 'adapter' in param else 'model'} `{model}` does not exist or "
                                "has no live worker.", param=param)

    def owns(self, tenant: str) -> bool:
        """Whether stored work of `tenant` (a response, a stream) is this caller's to see."""
        return self.key is None or tenant == self.tenant


ANONYMOUS = Caller(tenant="")
CALLER = web.RequestKey("caller", Caller)


def caller_of(request: web.Request) -> Caller:
    return request.get(CALLER, ANONYMOUS)


def presented_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return next((value.strip() for name in KEY_HEADERS if (value := request.headers.get(name, "")).strip()), None)


class KeyCache:
    """Key records by presented key, kept `ttl_s` at most, and dropped as soon as a change is announced.

    While the change channel is down the cache is bypassed: a revoke must never wait for a TTL."""

    def __init__(self, redis: aioredis.Redis, channels: aioredis.Redis, ttl_s: float,
                 on_revoked: Callable[[str], None] | None = None) -> None:
        self.redis = redis
        self.channels = channels
        self.ttl_s = ttl_s
        self.on_revoked = on_revoked
        """Called with the id of a key that was revoked (or has expired): its streams end at once."""
        self.entries: dict[str, tuple[KeyRecord, float]] = {}
        self.listening = False
        self.changes = 0
        """Key changes seen so far: a record read while one came in may be the old one, and is not kept."""
        self.expiries: dict[str, tuple[int, asyncio.TimerHandle]] = {}
        """By key id: the expiry of a key this edge admitted, and the timer that ends its work then, as a revoke
        does (nothing announces an expiry); set again when the key's expiry changes."""
        self.checks: set[asyncio.Task[None]] = set()

    async def authenticate(self, request: web.Request) -> Caller:
        key = presented_key(request)
        if key is None:
            raise Unauthenticated("You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
        record = await self.find(key)
        if record is None or record.expired():
            raise Unauthenticated("Incorrect API key provided, or the key was revoked or has expired.")
        self._arm(record.id, record.expires_at)
        return Caller(tenant=record.tenant, key=record)

    def _arm(self, key_id: str, expires_at: int) -> None:
        """The key's expiry timer, for the expiry it has now (0: none)."""
        armed = self.expiries.get(key_id)
        if armed is not None and armed[0] == expires_at:
            return
        if armed is not None:
            armed[1].cancel()
            del self.expiries[key_id]
        if expires_at:
            handle = asyncio.get_running_loop().call_later(max(0.0, expires_at - time.time()), self._expiring, key_id)
            self.expiries[key_id] = (expires_at, handle)

    def _expiring(self, key_id: str) -> None:
        """A key this edge admitted reached its expiry: unless it was given a later one meanwhile (its next request
        schedules that), its streams and background jobs end as at a revoke."""
        del self.expiries[key_id]
        task = asyncio.create_task(self._expired(key_id))
        self.checks.add(task)
        task.add_done_callback(self.checks.discard)

    async def _expired(self, key_id: str) -> None:
        try:
            await self.changed(key_id)
        except REDIS_FAILURES as exc:  # it was due to expire: it ends
            log.warning("could not read a key at its expiry (%s); ending its requests", type(exc).__name__)
            self.forget(key_id)
            if self.on_revoked is not None:
                self.on_revoked(key_id)

    def close(self) -> None:
        for _expires_at, handle in self.expiries.values():
            handle.cancel()
        self.expiries.clear()

    async def find(self, key: str) -> KeyRecord | None:
        cached = self.entries.get(key)
        if cached is not None and self.listening and time.monotonic() - cached[1] < self.ttl_s:
            return cached[0]
        changes = self.changes
        record = await apikeys.lookup(self.redis, key)
        if record is None:
            self.entries.pop(key, None)
        elif self.listening and changes == self.changes:
            self.entries[key] = (record, time.monotonic())
        return record

    async def changed(self, key_id: str) -> None:
        """A key changed: its cached records go, and if it no longer admits anyone its streams end; else its expiry
        timer follows its expiry (shortened, given, extended or taken away)."""
        self.forget(key_id)
        if self.on_revoked is None:
            return
        record = await apikeys.get(self.redis, key_id)
        if record is None or record.expired():
            self._arm(key_id, 0)
            self.on_revoked(key_id)
        else:
            self._arm(key_id, record.expires_at)

    def forget(self, key_id: str) -> None:
        self.changes += 1
        for key in [k for k, (record, _at) in self.entries.items() if record.id == key_id]:
            del self.entries[key]

    async def listen(self) -> None:
        """Follows the key change channel for good; each (re)subscription starts from an empty cache."""
        while True:
            pubsub = None
            try:
                pubsub = await redis_clients.subscriber(self.channels)
                await pubsub.subscribe(keys.KEY_CHANGES_CHANNEL)
                self.entries.clear()
                self.listening = True
                async for message in pubsub.listen():
                    await self.changed(message["data"].decode())
            except REDIS_FAILURES as exc:
                log.warning("key change channel lost (%s); resubscribing", type(exc).__name__)
            finally:
                self.listening = False
                self.entries.clear()
                if pubsub is not None:
                    with contextlib.suppress(*REDIS_FAILURES):
                        await pubsub.aclose()
            await asyncio.sleep(RESUBSCRIBE_PAUSE_S)


@contextlib.asynccontextmanager
async def listening(cache: KeyCache) -> AsyncIterator[None]:
    try:
        async with looping(key_changes=cache.listen()):
            yield
    finally:
        cache.close()
