"""Uploaded files (the Files API: what a batch reads, and what it writes) in Redis, per tenant: a description
key, the bytes in chunks of CHUNK_BYTES in a list beside it, and the tenant's index of its files; charged to the
tenant's storage as one item with all its bytes, expiring --response-ttl-s after upload. Storing and deleting are
one script each: the quota check, the writes and the tally together."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis

from services.edge.redis_boundary import redis_boundary
from services.edge.store import Quota
from shared.protocol import bus, keys
from shared.protocol.errors import NotFound, Overloaded, StorageFull
from shared.tenancy.storage import GIVE_BACK, TRIM_EXPIRED

CHUNK_BYTES = 1 << 20
PAGE_STEP = 500
"""Index entries one read of a filtered list takes (10,000 files: 20 reads)."""

_PUT = TRIM_EXPIRED + """
-- KEYS[3] the description, KEYS[4] the chunks, KEYS[5] the tenant's index. ARGV: now, max bytes, max items, member,
-- expires at (ms), created (ms), file id, description, then the chunks. Returns {1} or {0, held, items}.
local size = #ARGV[8]
for i = 9, #ARGV do size = size + #ARGV[i] end
local max_bytes, max_items = tonumber(ARGV[2]), tonumber(ARGV[3])
if (max_bytes > 0 and held + size > max_bytes) or (max_items > 0 and items + 1 > max_items) then
  return {0, held, items}
end
redis.call('SET', KEYS[3], ARGV[8], 'PXAT', ARGV[5])
if #ARGV >= 9 then
  redis.call('RPUSH', KEYS[4], unpack(ARGV, 9))
  redis.call('PEXPIREAT', KEYS[4], ARGV[5])
end
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[7])
-- the index drops the files made a lifetime ago (expired by now: every file lives as long), lest it keep them all
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. (tonumber(ARGV[1]) - (tonumber(ARGV[5]) - tonumber(ARGV[6]))))
redis.call('HSET', tally, ARGV[4], size, 'bytes', held + size, 'items', items + 1)
redis.call('ZADD', expiry, ARGV[5], ARGV[4])
return {1}
"""

_SEAL = TRIM_EXPIRED + """
-- A file whose chunks were written already (FileWriter). KEYS[3] the description, KEYS[4] the chunks, KEYS[5] the
-- tenant's index, KEYS[6] the chunks as written. ARGV: now, member, expires at (ms), created (ms), file id,
-- description, the chunks' bytes. Returns 1, or 0 when the file is there already (another edge sealed it).
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('DEL', KEYS[6])
  return 0
end
local size = #ARGV[6] + tonumber(ARGV[7])
redis.call('SET', KEYS[3], ARGV[6], 'PXAT', ARGV[3])
redis.call('RENAME', KEYS[6], KEYS[4])
redis.call('PEXPIREAT', KEYS[4], ARGV[3])
redis.call('ZADD', KEYS[5], ARGV[4], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. (tonumber(ARGV[1]) - (tonumber(ARGV[3]) - tonumber(ARGV[4]))))
redis.call('HSET', tally, ARGV[2], size, 'bytes', held + size, 'items', items + 1)
redis.call('ZADD', expiry, ARGV[3], ARGV[2])
return 1
"""

_DELETE = TRIM_EXPIRED + """
-- KEYS[3] the description, KEYS[4] the chunks, KEYS[5] the tenant's index. ARGV: now, member, file id.
redis.call('ZREM', KEYS[5], ARGV[3])
if redis.call('DEL', KEYS[3]) == 0 then
  return 0
end
redis.call('DEL', KEYS[4])
""" + GIVE_BACK


class FileInfo(msgspec.Struct):
    """A file as the Files API describes it."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None


_decode_info = msgspec.json.Decoder(FileInfo).decode


def not_found(file_id: str, param: str = "file_id") -> NotFound:
    return NotFound(f"No file with id '{file_id}' found.", param=param)


class FileStore:
    def __init__(self, redis: aioredis.Redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_ms = int(ttl_s * 1000)
        self._put = redis.register_script(_PUT)
        self._delete = redis.register_script(_DELETE)
        self._seal = redis.register_script(_SEAL)

    def _keys(self, tenant: str, file_id: str) -> list[str]:
        return [keys.storage_tally(tenant), keys.storage_expiry(tenant), keys.file(tenant, file_id),
                keys.file_chunks(tenant, file_id), keys.files(tenant)]

    async def put(self, tenant: str, quota: Quota, info: FileInfo, data: bytes) -> FileInfo:
        """Stores a file (or refuses it: StorageFull) and returns its description, its expiry set."""
        now = bus.now_ms()
        info.expires_at = (now + self.ttl_ms) // 1000
        chunks = [data[at:at + CHUNK_BYTES] for at in range(0, len(data), CHUNK_BYTES)]
        with redis_boundary(Overloaded):
            found: list[Any] = await self._put(
                keys=self._keys(tenant, info.id),
                args=[now, quota.bytes, quota.items, f"f:{info.id}", now + self.ttl_ms, now, info.id,
                      msgspec.json.encode(info), *chunks])
        if not int(found[0]):
            raise StorageFull(
                f"Your storage is full ({int(found[1])} bytes in {int(found[2])} items; the limits are "
                f"{quota.bytes or 'unlimited'} bytes and {quota.items or 'unlimited'} items): the file could not be "
                "stored. Delete files, stored responses or conversations, or wait for them to expire.", param="file")
        return info

    def writer(self, tenant: str, info: FileInfo) -> FileWriter:
        """A file (of the edge's own: a batch's output) written a chunk at a time, charged without a quota check
        when sealed (see FileWriter)."""
        return FileWriter(self, tenant, info)

    async def info(self, tenant: str, file_id: str, param: str = "file_id") -> FileInfo:
        with redis_boundary(Overloaded):
            raw = await self.redis.get(keys.file(tenant, file_id))
        if raw is None:
            raise not_found(file_id, param)
        return _decode_info(raw)

    async def content(self, tenant: str, file_id: str, param: str = "file_id") -> bytes:
        await self.info(tenant, file_id, param)
        with redis_boundary(Overloaded):
            chunks: list[bytes] = await self.redis.lrange(keys.file_chunks(tenant, file_id), 0, -1)  # type: ignore[assignment]
        return b"".join(chunks)

    async def chunks(self, tenant: str, file_id: str) -> tuple[FileInfo, AsyncIterator[bytes]]:
        """A file's description and its bytes, a chunk (CHUNK_BYTES) read at a time as they are sent: one download
        holds one chunk, however large the file (one deleted meanwhile ends short)."""
        info = await self.info(tenant, file_id)

        async def read() -> AsyncIterator[bytes]:
            for at in range(-(-info.bytes // CHUNK_BYTES)):
                with redis_boundary(Overloaded):
                    chunk: bytes | None = await self.redis.lindex(keys.file_chunks(tenant, file_id), at)  # type: ignore[assignment]
                if chunk is None:
                    return
                yield chunk
        return info, read()

    async def page(self, tenant: str, limit: int, newest_first: bool, after: str = "",
                   purpose: str = "") -> tuple[list[FileInfo], bool]:
        """Up to `limit` of the tenant's files after the one named `after` (none: from the first), in upload
        order or newest first, of one `purpose` if given; and whether more follow. Reads the tenant's index a page
        at a time from where the page starts, never the whole of it (an expired file's entry is dropped on the
        way)."""
        index = keys.files(tenant)
        start = 0
        with redis_boundary(Overloaded):
            if after:
                rank = await (self.redis.zrevrank(index, after) if newest_first else self.redis.zrank(index, after))
                if rank is None:
                    return [], False
                start = cast(int, rank) + 1
            found: list[FileInfo] = []
            step = max(limit, PAGE_STEP) if purpose else limit  # a filter may skip many: fewer, larger reads
            while len(found) <= limit:
                members: list[bytes] = await self.redis.zrange(index, start, start + step, desc=newest_first)  # type: ignore[assignment]
                if not members:
                    break
                start += len(members)
                ids = [member.decode() for member in members]
                raws = await self.redis.mget([keys.file(tenant, i) for i in ids])
                if gone := [file_id for file_id, raw in zip(ids, raws, strict=True) if raw is None]:
                    await self.redis.zrem(index, *gone)
                    start -= len(gone)
                described = (_decode_info(raw) for raw in raws if raw is not None)
                found += [info for info in described if not purpose or info.purpose == purpose]
        return found[:limit], len(found) > limit

    async def delete(self, tenant: str, file_id: str) -> None:
        with redis_boundary(Overloaded):
            deleted = await self._delete(keys=self._keys(tenant, file_id), args=[bus.now_ms(), f"f:{file_id}", file_id])
        if not int(deleted):
            raise not_found(file_id)


class FileWriter:
    """A file written as its bytes come, a chunk (CHUNK_BYTES) at a time, and sealed at its end in one script (its
    description, the tenant's index and tally; no quota check): what a batch's output and error files are, whose
    answers may come to the whole storage quota (64 MiB). Built whole from every answer at once, they held 3.6
    times their size of the edge's memory at once and its loop ~120 ms; written this way they hold two chunks.
    Until it is sealed the file is not there: its chunks are written beside it, under a key of this writer's own
    (expiring as the file would), so a driver that died writing it leaves it to the next, which writes it again
    from its first chunk, and two drivers at once (a lease lost) never mix their chunks: the first to seal it
    stores the file, the other's chunks go."""

    def __init__(self, store: FileStore, tenant: str, info: FileInfo) -> None:
        self.store = store
        self.tenant = tenant
        self.info = info
        self.pending = bytearray()
        self.written = 0
        """Bytes in the chunks pushed so far."""
        self.chunks_key = keys.file_chunks_writing(tenant, info.id, uuid.uuid4().hex)

    async def add(self, data: bytes) -> None:
        self.pending += data
        while len(self.pending) >= CHUNK_BYTES:
            await self._push(bytes(self.pending[:CHUNK_BYTES]))
            del self.pending[:CHUNK_BYTES]

    async def _push(self, chunk: bytes) -> None:
        with redis_boundary(Overloaded):
            pipe = self.store.redis.pipeline(transaction=False)
            pipe.rpush(self.chunks_key, chunk)
            pipe.pexpireat(self.chunks_key, bus.now_ms() + self.store.ttl_ms)
            await pipe.execute()
        self.written += len(chunk)

    async def seal(self) -> FileInfo | None:
        """Stores the file with what was added (None, and nothing stored, when nothing was)."""
        if self.pending:
            await self._push(bytes(self.pending))
            self.pending.clear()
        if not self.written:
            return None
        now = bus.now_ms()
        self.info.bytes, self.info.expires_at = self.written, (now + self.store.ttl_ms) // 1000
        with redis_boundary(Overloaded):
            await self.store._seal(
                keys=[*self.store._keys(self.tenant, self.info.id), self.chunks_key],
                args=[now, f"f:{self.info.id}", now + self.store.ttl_ms, now, self.info.id,
                      msgspec.json.encode(self.info), self.written])
        return self.info
