"""Conversations-API conversations in Redis, per tenant: a conversation's id, creation time and metadata in one
key and its items (JSON, oldest first) in a list beside it, both charged to the tenant's storage as one item and
expiring --response-ttl-s after their last change. Every change is one script on the tenant's Redis Cluster slot:
the quota check, the write and the tally together, so two turns of one conversation at once both land."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis

from services.edge.redis_boundary import redis_boundary
from services.edge.store import Quota, ResponseStore, Turn, stored_item_id
from shared.protocol import bus, keys
from shared.protocol.errors import InvalidRequest, NotFound, Overloaded, StorageFull
from shared.tenancy.storage import TRIM_EXPIRED

log = logging.getLogger(__name__)

_CHANGE = TRIM_EXPIRED + """
-- KEYS[3] the conversation, KEYS[4] its items, KEYS[5] the responses whose turns it holds. ARGV: now, max bytes
-- (0: none), max items (0: none), member, op, expires at (ms), the most bytes and items one conversation holds,
-- then the op's values: create (the conversation, then items), append (a response id or '', then items), meta
-- (the conversation), remove (an item's exact value), delete (none).
-- Returns {1} done, {0, held, items} refused (storage full), {-1} no such conversation, {-2} no such item, {-4}
-- the conversation would outgrow its bounds.
local member, op, at = ARGV[4], ARGV[5], ARGV[6]
local max_bytes, max_items = tonumber(ARGV[2]), tonumber(ARGV[3])
local old = tonumber(redis.call('HGET', tally, member) or '0')
local exists = redis.call('EXISTS', KEYS[3]) == 1
if op == 'create' then
  if exists then return {-3} end
elseif not exists then
  return {-1}
end
if op == 'delete' then
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
  if redis.call('HDEL', tally, member) == 1 then
    redis.call('HSET', tally, 'bytes', held - old, 'items', items - 1)
  end
  redis.call('ZREM', expiry, member)
  return {1}
end
local delta, one = 0, 0
if op == 'create' then
  one = 1
  for i = 9, #ARGV do delta = delta + #ARGV[i] end
elseif op == 'append' then
  -- a response's turn is added once, however many edges render its end (a resumed stream)
  if ARGV[9] ~= '' and redis.call('SISMEMBER', KEYS[5], ARGV[9]) == 1 then return {1} end
  for i = 10, #ARGV do delta = delta + #ARGV[i] end
elseif op == 'meta' then
  delta = #ARGV[9] - redis.call('STRLEN', KEYS[3])
elseif op == 'remove' then
  if redis.call('LREM', KEYS[4], 1, ARGV[9]) == 0 then return {-2} end
  delta = -#ARGV[9]
end
if (op == 'create' or op == 'append') and (old + delta > tonumber(ARGV[7])
    or redis.call('LLEN', KEYS[4]) + #ARGV - 9 > tonumber(ARGV[8])) then
  return {-4}
end
if delta > 0 and ((max_bytes > 0 and held + delta > max_bytes) or (max_items > 0 and items + one > max_items)) then
  return {0, held, items}
end
if op == 'create' or op == 'meta' then
  redis.call('SET', KEYS[3], ARGV[9], 'PXAT', at)
else
  redis.call('PEXPIREAT', KEYS[3], at)
end
if op == 'append' and ARGV[9] ~= '' then
  redis.call('SADD', KEYS[5], ARGV[9])
end
if (op == 'create' or op == 'append') and #ARGV >= 10 then
  redis.call('RPUSH', KEYS[4], unpack(ARGV, 10))
end
redis.call('PEXPIREAT', KEYS[4], at)
redis.call('PEXPIREAT', KEYS[5], at)
redis.call('HSET', tally, member, old + delta, 'bytes', held + delta, 'items', items + one)
redis.call('ZADD', expiry, at, member)
return {1}
"""


class Header(msgspec.Struct, omit_defaults=True):
    """What a conversation is besides its items."""

    id: str
    created_at: int
    metadata: dict[str, str] = {}


@dataclass(frozen=True)
class Stored:
    header: Header
    items: list[dict[str, Any]]
    """Its items, oldest first, as the API shows them."""


_decode_header = msgspec.json.Decoder(Header).decode
_decode_item = msgspec.json.Decoder(dict[str, Any]).decode


def not_found(conversation_id: str, param: str = "conversation_id") -> NotFound:
    return NotFound(f"Conversation with id '{conversation_id}' not found.", param=param)


async def keep_turn(store: ResponseStore, conversations: ConversationStore, tenant: str, turn: Turn) -> bool:
    """Stores a finished Responses turn, once: the response (when it is to be stored) and its items in its
    conversation (one deleted meanwhile takes nothing). False, and nothing stored, when its response is stored
    already (by a cancel, another edge, or an earlier read of a replayed stream, which planned again after the
    turn joined its conversation would store it with that turn twice in its history) or was deleted while it ran."""
    if turn.stored and not await store.keep(tenant, turn):
        return False
    if turn.conversation_id:
        try:
            await conversations.append(tenant, Quota(0, 0), turn.conversation_id, list(turn.items), turn.response_id)
        except (NotFound, InvalidRequest) as exc:  # deleted meanwhile, or full: the answer was given all the same
            log.warning("response %s's turn was not added to its conversation: %s", turn.response_id, exc.message)
    return True


class ConversationStore:
    def __init__(self, redis: aioredis.Redis, ttl_s: float, max_bytes: int, max_items: int) -> None:
        self.redis = redis
        self.ttl_ms = int(ttl_s * 1000)
        self.max_bytes = max_bytes
        self.max_items = max_items
        """What one conversation may hold: what one request may carry (its body, its messages), since each turn
        sends all of it to the engine; so reading one costs an edge no more than reading a request."""
        self._change = redis.register_script(_CHANGE)

    async def _run(self, tenant: str, quota: Quota, conversation_id: str, op: str, *values: bytes) -> None:
        with redis_boundary(Overloaded):
            found: list[Any] = await self._change(
                keys=[keys.storage_tally(tenant), keys.storage_expiry(tenant),
                      keys.conversation(tenant, conversation_id), keys.conversation_items(tenant, conversation_id),
                      keys.conversation_turns(tenant, conversation_id)],
                args=[bus.now_ms(), quota.bytes, quota.items, f"c:{conversation_id}", op,
                      bus.now_ms() + self.ttl_ms, self.max_bytes, self.max_items, *values])
        status = int(found[0])
        if status == -1:
            raise not_found(conversation_id)
        if status == -2:
            raise NotFound("No such item in the conversation.", param="item_id")
        if status == -4:
            raise InvalidRequest(f"A conversation holds at most {self.max_items} items and {self.max_bytes} bytes "
                                 "(what one request may carry); start a new one, with a summary of this one.",
                                 param="items")
        if status == 0:
            raise StorageFull(
                f"Your storage is full ({int(found[1])} bytes in {int(found[2])} items; the limits are "
                f"{quota.bytes or 'unlimited'} bytes and {quota.items or 'unlimited'} items): the conversation "
                "could not be stored. Delete stored responses or conversations, or wait for them to expire.")

    async def create(self, tenant: str, quota: Quota, header: Header, items: list[bytes]) -> None:
        await self._run(tenant, quota, header.id, "create", msgspec.json.encode(header), *items)

    async def append(self, tenant: str, quota: Quota, conversation_id: str, items: list[bytes],
                     response_id: str = "") -> None:
        """Adds items (a response's turn, once: `response_id`)."""
        if items:
            await self._run(tenant, quota, conversation_id, "append", response_id.encode(), *items)

    async def set_header(self, tenant: str, quota: Quota, header: Header) -> None:
        await self._run(tenant, quota, header.id, "meta", msgspec.json.encode(header))

    async def remove(self, tenant: str, conversation_id: str, item: bytes) -> None:
        await self._run(tenant, Quota(0, 0), conversation_id, "remove", item)

    async def delete(self, tenant: str, conversation_id: str) -> None:
        await self._run(tenant, Quota(0, 0), conversation_id, "delete")

    async def header(self, tenant: str, conversation_id: str) -> Header:
        """The conversation's header alone (none of its items read); NotFound if there is none."""
        with redis_boundary(Overloaded):
            header = await self.redis.get(keys.conversation(tenant, conversation_id))
        if header is None:
            raise not_found(conversation_id)
        return _decode_header(header)

    async def page(self, tenant: str, conversation_id: str, limit: int, newest_first: bool,
                   after: str = "") -> tuple[list[dict[str, Any]], bool] | None:
        """Up to `limit` items after the item `after` (none: from the first), oldest or newest first, and whether
        more follow; None: no item `after`. Only the page's items are decoded whole (finding `after` reads the
        others' ids only), and without `after` only the page is read."""
        items_key = keys.conversation_items(tenant, conversation_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(keys.conversation(tenant, conversation_id))
        if after:
            pipe.lrange(items_key, 0, -1)
        elif newest_first:
            pipe.lrange(items_key, -(limit + 1), -1)
        else:
            pipe.lrange(items_key, 0, limit)
        with redis_boundary(Overloaded):
            exists, raw = await pipe.execute()
        if not exists:
            raise not_found(conversation_id)
        raw = raw[::-1] if newest_first else raw
        if after:
            at = next((i for i, item in enumerate(raw) if stored_item_id(item) == after), None)
            if at is None:
                return None
            raw = raw[at + 1:]
        return [_decode_item(item) for item in raw[:limit]], len(raw) > limit

    async def item(self, tenant: str, conversation_id: str,
                   item_id: str) -> tuple[Header, dict[str, Any], bytes] | None:
        """The conversation's header, and its item `item_id` decoded and as stored (the others' ids only are
        read); None: no such item."""
        header = await self.header(tenant, conversation_id)
        with redis_boundary(Overloaded):
            raw: list[bytes] = await self.redis.lrange(keys.conversation_items(tenant, conversation_id), 0, -1)  # type: ignore[assignment]
        found = next((item for item in raw if stored_item_id(item) == item_id), None)
        return None if found is None else (header, _decode_item(found), found)

    async def items(self, tenant: str, wanted: dict[str, str], most: int, field: str = "input") -> dict[str, bytes]:
        """The items `wanted` names (item id: the conversation it was added to, see formats.item_refs) that are
        found, each as stored; items of more than `most` conversations are a 400 naming the request's `field` (each
        is read whole, as a page of its items is)."""
        homes = sorted(set(wanted.values()))
        if len(homes) > most:
            raise InvalidRequest(f"This request references items of {len(homes)} conversations; at most {most} are "
                                 "read for one request. Reference fewer, or send the items themselves.", param=field)
        if not homes:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for home in homes:
            pipe.lrange(keys.conversation_items(tenant, home), 0, -1)
        with redis_boundary(Overloaded):
            lists: list[list[bytes]] = await pipe.execute()
        return {name: item for raw in lists for item in raw if (name := stored_item_id(item)) in wanted}

    async def load(self, tenant: str, conversation_id: str,
                   param: str = "conversation_id") -> tuple[Stored, list[bytes]]:
        """The conversation and its items as stored (the exact values, to remove one); NotFound (naming `param`)
        if there is none."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(keys.conversation(tenant, conversation_id))
        pipe.lrange(keys.conversation_items(tenant, conversation_id), 0, -1)
        with redis_boundary(Overloaded):
            header, raw_items = await pipe.execute()
        if header is None:
            raise not_found(conversation_id, param)
        return Stored(_decode_header(header), [_decode_item(item) for item in raw_items]), list(raw_items)
