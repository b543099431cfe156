"""API keys: what a key may do and how much, kept in Redis by its hash (the key itself is shown once, at
creation, and stored nowhere). The `tokenbus keys` commands and every edge use this module.

A key's id is the first 16 hex digits of its hash: safe to print, log and pass on the command line.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from datetime import UTC, datetime

import msgspec
import redis.asyncio as aioredis

from shared.protocol import keys

KEY_PREFIX = "tb-"
QUOTA_PERIODS = ("day", "month")
MAX_PRIORITY = 9


class KeyRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One API key's tenant and limits; 0 means no limit."""

    id: str
    hash: str
    tenant: str
    created_at: int
    """Unix seconds."""
    models: list[str] = []
    """Models the key may use; empty: all."""
    rpm: int = 0
    """Requests per minute."""
    tpm: int = 0
    """Tokens per minute: prompt plus completion, reserved at admission and settled at the end."""
    max_concurrency: int = 0
    """Requests in flight at once."""
    quota_tokens: int = 0
    """Tokens per quota period."""
    quota_period: str = "month"
    weight: float = 1.0
    """Share of a model's workers relative to other tenants' keys (fair share)."""
    priority: int = 0
    """Strict priority band, 0 to 9: queued work of a higher band always goes first."""
    expires_at: int = 0
    """Unix seconds after which the key stops working; 0: never."""
    hint: str = ""
    """The key's last four characters, to tell keys apart in listings."""
    storage_bytes: int | None = None
    """Bytes its tenant may hold stored (responses, resumable streams); None: the deployment's --storage-bytes,
    so that a key made without limits is still bounded; 0: no limit, only when asked for."""
    storage_items: int | None = None
    """Stored responses its tenant may hold; None: the deployment's --storage-items; 0: no limit."""

    def expired(self, now: float | None = None) -> bool:
        return bool(self.expires_at) and (time.time() if now is None else now) >= self.expires_at

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models

    def quota_window(self, now: float | None = None) -> str:
        """The quota period `now` falls in: 2026-11-23 (day) or 2026-11 (month), in UTC."""
        moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
        return moment.strftime("%Y-%m-%d" if self.quota_period == "day" else "%Y-%m")


class KeyChanges(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What `keys create` and `keys update` may set."""

    tenant: str | None = None
    models: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    quota_tokens: int | None = None
    quota_period: str | None = None
    weight: float | None = None
    priority: int | None = None
    expires_at: int | None = None
    storage_bytes: int | None = None
    storage_items: int | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(KeyRecord)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check(record: KeyRecord) -> None:
    """Refuses settings no edge could honour, with a message for the operator."""
    if not record.tenant:
        raise ValueError("a key needs a tenant")
    for name in ("rpm", "tpm", "max_concurrency", "quota_tokens", "storage_bytes", "storage_items"):
        if (getattr(record, name) or 0) < 0:
            raise ValueError(f"{name} must be 0 (no limit) or more")
    if record.quota_period not in QUOTA_PERIODS:
        raise ValueError(f"quota period must be one of {', '.join(QUOTA_PERIODS)}")
    if not record.weight > 0:
        raise ValueError("weight must be above 0")
    if not 0 <= record.priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be between 0 and {MAX_PRIORITY}")


def _apply(record: KeyRecord, changes: KeyChanges) -> KeyRecord:
    given = {f: v for f in changes.__struct_fields__ if (v := getattr(changes, f)) is not None}
    updated = msgspec.structs.replace(record, **given)
    check(updated)
    return updated


async def create(redis: aioredis.Redis, changes: KeyChanges) -> tuple[str, KeyRecord]:
    """Makes a key; returns it (the only time it exists outside its holder) and its record."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = hash_key(key)
    blank = KeyRecord(id=digest[:16], hash=digest, tenant=changes.tenant or "", created_at=int(time.time()),
                      hint=key[-4:])
    record = _apply(blank, changes)
    pipe = redis.pipeline(transaction=True)
    pipe.hset(keys.API_KEYS, record.id, _encoder.encode(record))
    pipe.set(keys.api_key_by_hash(digest), record.id)
    await pipe.execute()
    await _announce(redis, record.id)
    return key, record


async def get(redis: aioredis.Redis, key_id: str) -> KeyRecord | None:
    raw = await redis.hget(keys.API_KEYS, key_id)
    return None if raw is None else _decoder.decode(raw)


async def lookup(redis: aioredis.Redis, key: str) -> KeyRecord | None:
    """The record of a presented key; None for an unknown or revoked one (expiry is the caller's check)."""
    key_id = await redis.get(keys.api_key_by_hash(hash_key(key)))
    if key_id is None:
        return None
    return await get(redis, key_id.decode() if isinstance(key_id, bytes) else key_id)


async def list_all(redis: aioredis.Redis) -> list[KeyRecord]:
    raw: dict[bytes, bytes] = await redis.hgetall(keys.API_KEYS)  # type: ignore[assignment]
    return sorted((_decoder.decode(v) for v in raw.values()), key=lambda r: (r.tenant, r.created_at, r.id))


async def update(redis: aioredis.Redis, key_id: str, changes: KeyChanges) -> KeyRecord | None:
    """Changes a key's settings; every edge drops its cached copy at once."""
    record = await get(redis, key_id)
    if record is None:
        return None
    updated = _apply(record, changes)
    await redis.hset(keys.API_KEYS, key_id, _encoder.encode(updated))
    await _announce(redis, key_id)
    return updated


async def revoke(redis: aioredis.Redis, key_id: str) -> KeyRecord | None:
    """Deletes a key; every edge refuses it from the moment it hears of it (well within a second)."""
    record = await get(redis, key_id)
    if record is None:
        return None
    pipe = redis.pipeline(transaction=True)  # the record and its hash lie in one slot (see keys.api_key_by_hash)
    pipe.hdel(keys.API_KEYS, key_id)
    pipe.delete(keys.api_key_by_hash(record.hash))
    await pipe.execute()
    await _announce(redis, key_id)
    return record


async def _announce(redis: aioredis.Redis, key_id: str) -> None:
    """Tells every edge that a key changed, once the change is written (a cluster does not publish from within
    a transaction)."""
    await redis.publish(keys.KEY_CHANGES_CHANNEL, key_id)
