"""What a tenant keeps in Redis, bounded: stored Responses-API responses (any edge can read, continue or delete
them) and resumable streams, charged against the tenant's storage quota.

Every stored item is charged, with when it expires, to its tenant's tally (bytes and items); deleting it gives
its bytes back at once, and its expiry does when the tenant next stores or deletes anything (expired items leave
the tally in the same script). A full tally refuses new items with StorageFull. All of one tenant's keys share
one hash tag (keys.tenant_tag), so each step is one script on one Redis Cluster slot.

A conversation is stored as a chain, not as copies: a response that continues another holds only what it added
(its input and its answer) and the id of the one it continued. A response that truncation cut, the first of a
conversation and every SNAPSHOT_EVERY-th one hold their whole history as it was run instead. So a chain's bytes
grow with its length, not its square, and resolving previous_response_id reads at most SNAPSHOT_EVERY records.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import redis.asyncio as aioredis

from services.edge.redis_boundary import REDIS_FAILURES, redis_boundary
from shared.protocol import bus, keys
from shared.protocol.errors import InvalidRequest, Overloaded, PreviousResponseNotFound, StorageFull
from shared.runtime import beats, metrics
from shared.runtime.background import looping
from shared.tenancy.apikeys import KeyRecord
from shared.tenancy.storage import GIVE_BACK, TRIM_EXPIRED

log = logging.getLogger(__name__)


class StoreSettings(Protocol):
    """The settings the store reads (Settings has them)."""

    @property
    def replay_ttl_s(self) -> float: ...
    @property
    def response_ttl_s(self) -> float: ...
    @property
    def storage_bytes(self) -> int: ...
    @property
    def storage_items(self) -> int: ...


SNAPSHOT_EVERY = 16
"""A chain holds a whole copy of its history at least every this many responses: what bounds the reads of one
resolution (each a round trip) at the price of one copy per this many turns."""
MEMORY_POLL_S = 10.0
"""How often an edge reads Redis's memory use for its metrics (the 80% alert reads them)."""

_CHARGE = TRIM_EXPIRED + """
-- ARGV: now, max bytes (0: none), max items (0: none), member, bytes, expires at (ms; 0: only check), value
-- or '' (KEYS[3] is its key), then the members of the responses in KEYS[4...]. A value is stored once: when its key
-- holds one already (stored by another edge, or a DELETE's bar) nothing is, and the answer is {2}
if ARGV[7] ~= '' and redis.call('EXISTS', KEYS[3]) == 1 then
  return {2, held, items, '0'}
end
local member, size, at = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local max_bytes, max_items = tonumber(ARGV[2]), tonumber(ARGV[3])
local old, one = redis.call('HGET', tally, member), counted(member)
if old then  -- stored again (a resumed stream settles once more): replaced, not counted twice
  held, items = held - tonumber(old), items - one
end
if (max_bytes > 0 and held + size > max_bytes) or (max_items > 0 and items + one > max_items) then
  local first = redis.call('ZRANGE', expiry, 0, 0, 'WITHSCORES')
  return {0, held, items, first[2] or '0'}
end
if at == '0' then  -- a check only: nothing is stored
  return {1, held, items, '0'}
end
redis.call('HSET', tally, member, size, 'bytes', held + size, 'items', items + one)
redis.call('ZADD', expiry, at, member)
if ARGV[7] ~= '' then
  redis.call('SET', KEYS[3], ARGV[7], 'PXAT', at)
end
-- the responses this one continues must live as long as it does: it holds only what it added to them
for i = 4, #KEYS do
  redis.call('PEXPIREAT', KEYS[i], at, 'GT')
  redis.call('ZADD', expiry, 'XX', 'GT', at, ARGV[4 + i])
end
return {1, held + size, items + one, '0'}
"""

_DELETE = TRIM_EXPIRED + """
if redis.call('DEL', KEYS[3]) == 0 then
  return 0
end
""" + GIVE_BACK


_READ_BOUNDED = """
-- KEYS: stored responses; ARGV[1]: the most bytes to read. Their values, or {false, their size} when they come to more
local size = 0
for _, key in ipairs(KEYS) do
  size = size + redis.call('STRLEN', key)
end
if size > tonumber(ARGV[1]) then
  return {false, size}
end
return {redis.call('MGET', unpack(KEYS)), size}
"""

REFERENCED_BODIES = 4
"""The stored responses one request's item references read come to at most this many request bodies
(--max-body-bytes): a record holds its input (one body at most), its answer and at most one copy of its history."""


class StoredResponse(msgspec.Struct, forbid_unknown_fields=False):
    response: msgspec.Raw
    """The response object exactly as it was sent."""
    history: list[bus.Message]
    """The conversation without instructions, the response's own output last: all of it as it was run when
    `previous` is empty, else only what this response added after `previous`'s history."""
    tenant: str = ""
    """Whose response it is: no other tenant may read, continue or delete it."""
    previous: str = ""
    """The response whose history comes before `history`; empty: `history` is whole."""
    inputs: list[msgspec.Raw] = []
    """This turn's input items as listed (GET /v1/responses/{id}/input_items): each with its id."""
    depth: int = 0
    """Records before this one back to a whole history (0: this one is whole)."""


class StoredHead(msgspec.Struct, forbid_unknown_fields=False):
    """A stored response as the routes that show it read it: its history (megabytes of messages, maybe) is skipped
    unread, which building took a GET of a 12 MB record ~50 ms of the edge's loop."""

    response: msgspec.Raw
    tenant: str = ""
    inputs: list[msgspec.Raw] = []


class _Output(msgspec.Struct):
    output: list[msgspec.Raw] = []


class _Items(msgspec.Struct):
    """A stored response's items alone (its history, however long, is skipped unread)."""

    response: _Output
    inputs: list[msgspec.Raw] = []


class _ItemId(msgspec.Struct):
    id: str = ""


_decode_items = msgspec.json.Decoder(_Items).decode
_decode_item_id = msgspec.json.Decoder(_ItemId).decode


def stored_item_id(item: bytes) -> str:
    """The id of a stored item (a response's, or a conversation's), read without building the rest of it."""
    return _decode_item_id(item).id


@dataclass
class Conversation:
    """What a new turn continues: the history its previous response ran with, that response's answer last."""

    history: list[bus.Message] = field(default_factory=list)
    previous: str = ""
    depth: int = 0
    """The previous response's depth (see StoredResponse.depth)."""
    chain: list[str] = field(default_factory=list)
    """The responses read to resolve it: storing the next turn extends them to its own expiry."""


@dataclass(frozen=True)
class Turn:
    """A finished Responses turn to store (what its renderer reports): the response object as it was sent, the
    conversation it continued, what it added to it, and the messages truncation dropped from the history."""

    response_id: str
    response: bytes
    conversation: Conversation
    added: list[bus.Message]
    dropped: int = 0
    stored: bool = True
    """The response is to be stored (`store`); else only its Conversations-API conversation takes its turn."""
    conversation_id: str = ""
    """The Conversations-API conversation it ran in (`conversation`), which takes `items` ("": none)."""
    items: tuple[bytes, ...] = ()
    """This turn's input items and the response's output items, as the conversation keeps them."""
    inputs: tuple[bytes, ...] = ()
    """This turn's input items as the stored response lists them (conversation_items.kept)."""


@dataclass(frozen=True)
class Quota:
    """What a tenant may hold stored; 0: no limit."""

    bytes: int
    items: int


def as_run(history: list[bus.Message], dropped: int) -> list[bus.Message]:
    """The history without the `dropped` oldest non-system messages: what truncation "auto" let the model see."""
    out = []
    for message in history:
        if dropped and message.role != "system":
            dropped -= 1
            continue
        out.append(message)
    return out


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoredResponse)
_decode_head = msgspec.json.Decoder(StoredHead).decode


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, settings: StoreSettings) -> None:
        self.redis = redis
        self.ttl_ms = int(settings.response_ttl_s * 1000)
        self.settings = settings
        self._charge = redis.register_script(_CHARGE)
        self._delete = redis.register_script(_DELETE)
        self._read_bounded = redis.register_script(_READ_BOUNDED)

    def quota(self, key: KeyRecord | None) -> Quota:
        """The key's own limits, or the deployment's where it has none (a key made without limits is bounded)."""
        given = (key.storage_bytes, key.storage_items) if key is not None else (None, None)
        return Quota(self.settings.storage_bytes if given[0] is None else given[0],
                     self.settings.storage_items if given[1] is None else given[1])

    async def _run_charge(self, tenant: str, quota: Quota, member: str, size: int, expires_ms: int,
                          value: bytes = b"", more: tuple[list[str], list[str]] = ([], [])) -> list[Any]:
        names, members = more
        value_key = [keys.stored_response(tenant, member[2:])] if value else []
        with redis_boundary(Overloaded):
            found: list[Any] = await self._charge(
                keys=[keys.storage_tally(tenant), keys.storage_expiry(tenant), *value_key, *names],
                args=[bus.now_ms(), quota.bytes, quota.items, member, size, expires_ms, value, *members])
        return found

    async def _charge_or_refuse(self, tenant: str, quota: Quota, member: str, size: int, expires_ms: int,
                                what: str, param: str | None) -> None:
        stored, held, items, first = await self._run_charge(tenant, quota, member, size, expires_ms)
        if int(stored):
            return
        wait_s = max(1.0, (float(first) - bus.now_ms()) / 1000)
        raise StorageFull(
            f"Your storage is full ({int(held)} bytes in {int(items)} items; the limits are "
            f"{quota.bytes or 'unlimited'} bytes and {quota.items or 'unlimited'} items): {what}. Delete stored "
            f"responses (DELETE /v1/responses/{{id}}), send `store: false`, or wait for stored items to expire.",
            param=param, retry_after_s=wait_s)

    async def check_room(self, tenant: str, key: KeyRecord | None, size: int,
                         what: str = "this response could not be stored", param: str = "store") -> None:
        """Refuses a response (or `what` else) to be stored when its tenant's storage cannot take `size` more bytes
        and an item; checked before the job runs (or the upload is read), so that a full store costs nothing."""
        await self._charge_or_refuse(tenant, self.quota(key), "r:", size, 0, what, param)

    async def charge_stream(self, tenant: str, key: KeyRecord | None, job: bus.Job, body_bytes: int) -> None:
        """Charges a resumable stream's request (kept to resume it, up to --max-body-bytes) until its log expires
        at the latest, or refuses the stream when its tenant's storage is full. Its event log is charged by the
        worker when the job ends (shared.tenancy.storage), as written: charging what it may grow to (max_tokens events)
        for as long as it may live would refuse a tenant's ordinary streaming. So a tenant overshoots its quota
        by at most the logs of the streams it has running, each bounded by --replay-max-events."""
        expires_ms = job.deadline_ms + job.log_kept_ms(int(self.settings.replay_ttl_s * 1000))
        await self._charge_or_refuse(tenant, self.quota(key), f"s:{job.id}", body_bytes, expires_ms,
                                     "a streamed request is kept to be resumed", None)

    async def save(self, tenant: str, response_id: str, response: bytes, conversation: Conversation,
                   added: list[bus.Message], dropped: int = 0, inputs: tuple[bytes, ...] = ()) -> bool:
        """Stores a finished response: what it added to the conversation, or its whole history as it ran (see the
        module's docstring). Past the quota too: its room was checked before it ran, and a tenant overshoots by
        at most the answers it had in flight when its storage filled. Once: False, and nothing stored, when the
        id holds a response already (another edge's, a cancel's, a replay's) or is barred (`bar`)."""
        chain: list[str] = []
        if conversation.previous and not dropped and conversation.depth + 1 < SNAPSHOT_EVERY:
            record = StoredResponse(response=msgspec.Raw(response), history=added, tenant=tenant,
                                    previous=conversation.previous, depth=conversation.depth + 1,
                                    inputs=[msgspec.Raw(item) for item in inputs])
            chain = conversation.chain
        else:
            whole = as_run(conversation.history + added, dropped)
            record = StoredResponse(response=msgspec.Raw(response), history=whole, tenant=tenant,
                                    inputs=[msgspec.Raw(item) for item in inputs])
        data = _encoder.encode(record)
        more = ([keys.stored_response(tenant, name) for name in chain], [f"r:{name}" for name in chain])
        found = await self._run_charge(tenant, Quota(0, 0), f"r:{response_id}", len(data),
                                       bus.now_ms() + self.ttl_ms, data, more)
        return int(found[0]) == 1

    async def bar(self, tenant: str, response_id: str, until_ms: int) -> None:
        """No response is stored under `response_id` until `until_ms` (Unix ms): that of a job still running when
        its response was deleted, whose answer may yet come to be stored. A barred id reads as none."""
        with redis_boundary(Overloaded):
            await self.redis.set(keys.stored_response(tenant, response_id), b"", pxat=until_ms, nx=True)

    async def keep(self, tenant: str, turn: Turn) -> bool:
        """Stores a finished turn, once (see `save`)."""
        return await self.save(tenant, turn.response_id, turn.response, turn.conversation, turn.added, turn.dropped,
                        turn.inputs)

    async def load(self, tenant: str, response_id: str) -> StoredResponse | None:
        data = await self._read(tenant, response_id)
        return _decoder.decode(data) if data else None

    async def head(self, tenant: str, response_id: str) -> StoredHead | None:
        """A stored response without its history (see StoredHead)."""
        data = await self._read(tenant, response_id)
        return _decode_head(data) if data else None

    async def _read(self, tenant: str, response_id: str) -> bytes | None:
        """A stored response's record; None or b"" when there is none (b"": barred, see `bar`)."""
        with redis_boundary(Overloaded):
            data: bytes | None = await self.redis.get(keys.stored_response(tenant, response_id))  # type: ignore[assignment]
        return data

    async def items(self, tenant: str, wanted: dict[str, str], max_bytes: int, field: str = "input"
                    ) -> dict[str, bytes]:
        """The stored items `wanted` names (item id: the response it is of, see formats.item_refs) that are
        found, each as its JSON; the responses read come to at most `max_bytes`, else a 400 naming the request's
        `field`."""
        homes = sorted(set(wanted.values()))
        if not homes:
            return {}
        with redis_boundary(Overloaded):
            values, size = await self._read_bounded(
                keys=[keys.stored_response(tenant, home) for home in homes], args=[max_bytes])
        if values is None:
            raise InvalidRequest(
                f"The responses whose items this request references come to {size} bytes; at most {max_bytes} are "
                f"read for one request. Reference fewer responses' items, or send the items themselves.",
                param=field)
        found: dict[str, bytes] = {}
        for data in values:
            if not data:  # gone (expired or deleted) since the ids were made
                continue
            record = _decode_items(data)
            for raw in (*record.inputs, *record.response.output):
                item = bytes(raw)
                if (name := stored_item_id(item)) in wanted:
                    found[name] = item
        return found

    async def conversation(self, tenant: str, response_id: str) -> Conversation | None:
        """The history a response ran with, its answer last (None: no such response); reads its chain back to a
        whole copy."""
        first = await self.load(tenant, response_id)
        if first is None:
            return None
        parts, chain, record = [first.history], [response_id], first
        for _ in range(SNAPSHOT_EVERY):
            if not record.previous:
                break
            name = record.previous
            found = await self.load(tenant, name)
            if found is None:  # deleted: its part of the conversation is gone with it
                raise PreviousResponseNotFound(
                    f"The conversation of '{response_id}' cannot be continued: an earlier response of it, "
                    f"'{name}', was deleted.", param="previous_response_id")
            record = found
            parts.append(record.history)
            chain.append(name)
        history = [message for part in reversed(parts) for message in part]
        return Conversation(history=history, previous=response_id, depth=first.depth, chain=chain)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Deletes a response and gives its bytes back to its tenant's storage."""
        with redis_boundary(Overloaded):
            return bool(await self._delete(
                keys=[keys.storage_tally(tenant), keys.storage_expiry(tenant),
                      keys.stored_response(tenant, response_id)],
                args=[bus.now_ms(), f"r:{response_id}"]))

    async def watch_memory(self) -> None:
        """Keeps the Redis memory metrics current (the fullest node of a cluster)."""
        while True:
            with contextlib.suppress(*REDIS_FAILURES):
                used, most = fullest(await self.redis.info("memory"))
                metrics.REDIS_USED_MEMORY.set(used)
                metrics.REDIS_MAXMEMORY.set(most)
            await beats.sleep_to_beat(MEMORY_POLL_S)


def fullest(info: dict[str, Any]) -> tuple[int, int]:
    """used_memory and maxmemory of one node's INFO, or of the node nearest its maxmemory when INFO answered
    per node (a cluster client)."""
    if "used_memory" in info:
        return int(info["used_memory"]), int(info.get("maxmemory", 0))
    nodes = [fullest(node) for node in info.values() if isinstance(node, dict)]
    return max(nodes, key=lambda n: n[0] / n[1] if n[1] else 0.0, default=(0, 0))


def watching(store: ResponseStore) -> contextlib.AbstractAsyncContextManager[None]:
    return looping(redis_memory=store.watch_memory())

