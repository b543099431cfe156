"""Batches in Redis (the Batch API): each batch's hash (its Batch as JSON, its tallies, the key it runs for), its
answered lines (one per custom_id, set once: exactly once whoever answers it), the tenant's index and its open
batches, the global set of open batches every edge looks through, and the lease of the edge driving each one.

A batch's answers are charged to its tenant's storage as they come (bytes, member b:<batch id>), so a tenant's
batch holds no more than its quota lets it; the output files that replace them at the end take their place."""

from __future__ import annotations

from typing import Any

import msgspec
import redis.asyncio as aioredis

from services.edge.redis_boundary import redis_boundary
from services.edge.store import Quota
from shared.protocol import bus, keys
from shared.protocol.errors import NotFound, Overloaded, RateLimited, StorageFull
from shared.tenancy.storage import TRIM_EXPIRED

INDEX_MARGIN_MS = 600_000
"""How long a batch stays in its tenant's index beyond the lifetime its record was given when it was made (its
window, then the time answers are kept): a batch ends by its window's end, give or take its finalizing, and is kept
from its end."""

_CREATE = TRIM_EXPIRED + """
-- KEYS[3] the batch, KEYS[4] the tenant's index, KEYS[5] its open batches. ARGV: now, max bytes, max items, batch
-- id, Batch JSON, key id, created (ms), expiry (ms), most open batches. Returns 1, 0 (too many open) or -1 (its
-- storage is full: the batch's record is an item, a:<id>, with its bytes, until it expires).
if tonumber(ARGV[9]) > 0 and redis.call('SCARD', KEYS[5]) >= tonumber(ARGV[9]) then return 0 end
local size = #ARGV[5] + 64
local max_bytes, max_items = tonumber(ARGV[2]), tonumber(ARGV[3])
if (max_bytes > 0 and held + size > max_bytes) or (max_items > 0 and items + 1 > max_items) then return -1 end
redis.call('HSET', KEYS[3], 'info', ARGV[5], 'key', ARGV[6])
redis.call('PEXPIREAT', KEYS[3], ARGV[8])
redis.call('ZADD', KEYS[4], ARGV[7], ARGV[4])
-- the index drops the batches made longer ago than a record lives (and a margin): they expired by now, and
-- it kept them all
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (tonumber(ARGV[1]) - (tonumber(ARGV[8]) - tonumber(ARGV[7]))
  - INDEX_MARGIN_MS))
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('HSET', tally, 'a:' .. ARGV[4], size, 'bytes', held + size, 'items', items + 1)
redis.call('ZADD', expiry, ARGV[8], 'a:' .. ARGV[4])
return 1
""".replace("INDEX_MARGIN_MS", str(INDEX_MARGIN_MS))

_ANSWER = TRIM_EXPIRED + """
-- KEYS[3] the batch, KEYS[4] its lines. ARGV: now, custom id, the line (o... or e...), tally counted (completed or
-- failed), input tokens, output tokens, member, expires at (ms). Returns {set, bytes held}.
if redis.call('HSETNX', KEYS[4], ARGV[2], ARGV[3]) == 0 then return {0, held} end
redis.call('PEXPIREAT', KEYS[4], ARGV[8])
local size = #ARGV[2] + #ARGV[3]
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
redis.call('HINCRBY', KEYS[3], 'input_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'output_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[3], 'output_bytes', size)
redis.call('HINCRBY', tally, ARGV[7], size)
redis.call('HSET', tally, 'bytes', held + size)
redis.call('ZADD', expiry, ARGV[8], ARGV[7])
return {1, held + size}
"""

_SETTLE = TRIM_EXPIRED + """
-- KEYS[3] the batch, KEYS[4] its lines, KEYS[5] the tenant's open batches. ARGV: now, member, batch id, Batch JSON,
-- expiry (ms). Its answers are in its files now: the lines go, and their bytes leave the tally.
redis.call('HSET', KEYS[3], 'info', ARGV[4])
redis.call('PEXPIREAT', KEYS[3], ARGV[5])
if redis.call('ZSCORE', expiry, 'a:' .. ARGV[3]) then redis.call('ZADD', expiry, ARGV[5], 'a:' .. ARGV[3]) end
redis.call('DEL', KEYS[4])
redis.call('SREM', KEYS[5], ARGV[3])
local size = redis.call('HGET', tally, ARGV[2])
if size then
  redis.call('HSET', tally, 'bytes', held - tonumber(size))
  redis.call('HDEL', tally, ARGV[2])
end
redis.call('ZREM', expiry, ARGV[2])
return 1
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct):
    data: list[BatchError]
    object: str = "list"


class Usage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"reasoning_tokens": 0})


class Batch(msgspec.Struct, kw_only=True):
    """A batch as the API shows it (and as Redis keeps its `info`, the tallies apart)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    object: str = "batch"
    model: str | None = None
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    usage: Usage = msgspec.field(default_factory=Usage)
    metadata: dict[str, str] | None = None


_TALLIES = ("completed", "failed", "input_tokens", "output_tokens", "output_bytes", "cancel")
_decode_batch = msgspec.json.Decoder(Batch).decode


class Found(msgspec.Struct):
    """A batch as Redis has it now: the Batch with its tallies, the key it runs for, and its answers' bytes."""

    batch: Batch
    key: str
    output_bytes: int
    cancel_asked: bool


def _too_many_open(max_open: int) -> RateLimited:
    return RateLimited(f"You have {max_open} batches open already: wait for one to end, or cancel one.",
                       limit="batches", retry_after_s=60)


def open_member(tenant: str, batch_id: str) -> str:
    return f"{tenant}\0{batch_id}"


class BatchStore:
    def __init__(self, redis: aioredis.Redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_ms = int(ttl_s * 1000)
        """How long a batch stays listed after it ended (the files' retention, --response-ttl-s)."""
        self._create = redis.register_script(_CREATE)
        self._answer = redis.register_script(_ANSWER)
        self._settle = redis.register_script(_SETTLE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def check_open(self, tenant: str, max_open: int) -> None:
        """RateLimited when the tenant has `max_open` batches open already: checked before a new one's input file
        is read (8 MB at most), as `create` checks it again when it stores the batch."""
        if max_open > 0:
            with redis_boundary(Overloaded):
                running = int(await self.redis.scard(keys.batches_running(tenant)))
            if running >= max_open:
                raise _too_many_open(max_open)

    async def create(self, tenant: str, key_id: str, batch: Batch, max_open: int, quota: Quota) -> None:
        """Stores a new batch and makes it open; its record is an item of the tenant's storage until it expires.
        RateLimited: the tenant has `max_open` open already; StorageFull: its storage has no room."""
        expires_ms = batch.expires_at * 1000 + self.ttl_ms
        with redis_boundary(Overloaded):
            # open first: a batch stored by an edge that died on the way is still found and driven (an open member
            # without a batch is dropped)
            await self.redis.zadd(keys.BATCHES_OPEN, {open_member(tenant, batch.id): batch.created_at * 1000})
            made = int(await self._create(
                keys=[keys.storage_tally(tenant), keys.storage_expiry(tenant), keys.batch(tenant, batch.id),
                      keys.batches(tenant), keys.batches_running(tenant)],
                args=[bus.now_ms(), quota.bytes, quota.items, batch.id, msgspec.json.encode(batch), key_id,
                      batch.created_at * 1000, expires_ms, max_open]))
        if made != 1:
            await self.redis.zrem(keys.BATCHES_OPEN, open_member(tenant, batch.id))
        if made == 0:
            raise _too_many_open(max_open)
        if made == -1:
            raise StorageFull("Your storage is full: a batch's record is kept as one item until it expires. Delete "
                              "files, stored responses or conversations, or wait for them to expire.",
                              param="input_file_id")

    async def load(self, tenant: str, batch_id: str) -> Found | None:
        with redis_boundary(Overloaded):
            raw: list[Any] = await self.redis.hmget(keys.batch(tenant, batch_id), ["info", "key", *_TALLIES])
        if raw[0] is None:
            return None
        batch = _decode_batch(raw[0])
        completed, failed, input_tokens, output_tokens, output_bytes = (int(v or 0) for v in raw[2:7])
        batch.request_counts = RequestCounts(total=batch.request_counts.total, completed=completed, failed=failed)
        batch.usage = Usage(input_tokens=input_tokens, output_tokens=output_tokens,
                            total_tokens=input_tokens + output_tokens)
        cancel_asked = raw[7] is not None
        if cancel_asked and batch.status in ("validating", "in_progress"):
            batch.status = "cancelling"
            batch.cancelling_at = int(raw[7]) // 1000
        return Found(batch, (raw[1] or b"-").decode(), output_bytes, cancel_asked)

    async def get(self, tenant: str, batch_id: str) -> Found:
        if (found := await self.load(tenant, batch_id)) is None:
            raise NotFound(f"No batch with id '{batch_id}' found.", param="batch_id")
        return found

    async def ids(self, tenant: str) -> list[str]:
        """The tenant's batches, newest first (those expired are dropped from the index on the way)."""
        with redis_boundary(Overloaded):
            members: list[bytes] = await self.redis.zrevrange(keys.batches(tenant), 0, -1)  # type: ignore[assignment]
        return [member.decode() for member in members]

    async def forget(self, tenant: str, batch_ids: list[str]) -> None:
        if batch_ids:
            with redis_boundary(Overloaded):
                await self.redis.zrem(keys.batches(tenant), *batch_ids)

    async def ask_cancel(self, tenant: str, batch_id: str) -> None:
        with redis_boundary(Overloaded):
            await self.redis.hsetnx(keys.batch(tenant, batch_id), "cancel", bus.now_ms())

    async def update(self, tenant: str, batch: Batch) -> None:
        """Writes the batch's status and times (its driver's)."""
        with redis_boundary(Overloaded):
            await self.redis.hset(keys.batch(tenant, batch.id), "info", msgspec.json.encode(batch))

    async def answered_ids(self, tenant: str, batch_id: str) -> set[str]:
        """The custom_ids answered so far (their answers left in Redis)."""
        with redis_boundary(Overloaded):
            found: list[bytes] = await self.redis.hkeys(keys.batch_lines(tenant, batch_id))  # type: ignore[assignment]
        return {custom_id.decode() for custom_id in found}

    async def answers(self, tenant: str, batch_id: str, custom_ids: list[str]) -> list[bytes | None]:
        """The answers of these lines (None: a line without one), read a page at a time by the caller: all of a
        batch's answers may come to its tenant's whole storage quota."""
        with redis_boundary(Overloaded):
            found: list[bytes | None] = await self.redis.hmget(keys.batch_lines(tenant, batch_id), custom_ids)  # type: ignore[assignment]
        return found

    async def answer(self, tenant: str, batch: Batch, custom_id: str, line: bytes, ok: bool,
                     usage: tuple[int, int]) -> int:
        """Records a line's answer unless it has one (an edge that drove the batch before recorded it); returns
        the bytes the tenant holds stored now."""
        with redis_boundary(Overloaded):
            found: list[Any] = await self._answer(
                keys=[keys.storage_tally(tenant), keys.storage_expiry(tenant), keys.batch(tenant, batch.id),
                      keys.batch_lines(tenant, batch.id)],
                args=[bus.now_ms(), custom_id, (b"o" if ok else b"e") + line, "completed" if ok else "failed",
                      usage[0], usage[1], f"b:{batch.id}", batch.expires_at * 1000 + self.ttl_ms])
        return int(found[1])

    async def settle(self, tenant: str, batch: Batch) -> None:
        """Ends the batch: its final state is written, its answers (in its files now) let go, and it is no longer
        open (for its tenant, and for every edge)."""
        with redis_boundary(Overloaded):
            await self._settle(
                keys=[keys.storage_tally(tenant), keys.storage_expiry(tenant), keys.batch(tenant, batch.id),
                      keys.batch_lines(tenant, batch.id), keys.batches_running(tenant)],
                args=[bus.now_ms(), f"b:{batch.id}", batch.id, msgspec.json.encode(batch), bus.now_ms() + self.ttl_ms])
            await self.redis.zrem(keys.BATCHES_OPEN, open_member(tenant, batch.id))

    # Who drives each open batch

    async def open_batches(self, limit: int) -> list[tuple[str, str]]:
        """(tenant, batch id) of open batches, oldest first."""
        with redis_boundary(Overloaded):
            members: list[bytes] = await self.redis.zrange(keys.BATCHES_OPEN, 0, limit - 1)  # type: ignore[assignment]
        found = [member.decode().partition("\0") for member in members]
        return [(tenant, batch_id) for tenant, _, batch_id in found]

    async def drop_open(self, tenant: str, batch_id: str) -> None:
        with redis_boundary(Overloaded):
            await self.redis.zrem(keys.BATCHES_OPEN, open_member(tenant, batch_id))
            await self.redis.srem(keys.batches_running(tenant), batch_id)

    async def claim(self, batch_id: str, driver: str, ttl_ms: int) -> bool:
        with redis_boundary(Overloaded):
            return bool(await self.redis.set(keys.batch_driver(batch_id), driver, nx=True, px=ttl_ms))

    async def renew(self, batch_id: str, driver: str, ttl_ms: int) -> bool:
        with redis_boundary(Overloaded):
            return bool(await self._renew(keys=[keys.batch_driver(batch_id)], args=[driver, ttl_ms]))

    async def release(self, batch_id: str, driver: str) -> None:
        with redis_boundary(Overloaded):
            await self._release(keys=[keys.batch_driver(batch_id)], args=[driver])


def failed_with(batch: Batch, errors: list[BatchError]) -> None:
    batch.status, batch.failed_at = "failed", int(bus.now_ms() // 1000)
    batch.errors = BatchErrors(data=errors)
