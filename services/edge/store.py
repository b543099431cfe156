"""Stored Responses-API responses in Redis: any edge can read, continue or delete them."""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import bus, keys
from shared.errors import Overloaded


class StoredResponse(msgspec.Struct, forbid_unknown_fields=False):
    response: msgspec.Raw
    """The response object exactly as it was sent."""
    history: list[bus.Message]
    """The conversation without instructions, the response's own output last."""
    tenant: str = ""
    """Whose response it is: no other tenant may read, continue or delete it."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoredResponse)


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_ms = int(ttl_s * 1000)

    async def save(self, response_id: str, response: bytes, history: list[bus.Message], tenant: str = "") -> None:
        data = _encoder.encode(StoredResponse(response=msgspec.Raw(response), history=history, tenant=tenant))
        try:
            await self.redis.set(keys.stored_response(response_id), data, px=self.ttl_ms)
        except RedisError as exc:
            raise Overloaded("The response could not be stored; try again.") from exc

    async def load(self, response_id: str) -> StoredResponse | None:
        try:
            data = await self.redis.get(keys.stored_response(response_id))
        except RedisError as exc:
            raise Overloaded("Stored responses are unavailable; try again.") from exc
        return None if data is None else _decoder.decode(data)

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self.redis.delete(keys.stored_response(response_id)))
        except RedisError as exc:
            raise Overloaded("Stored responses are unavailable; try again.") from exc
