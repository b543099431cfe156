"""A tenant's storage tally, the part edges and workers share: the script step that gives expired items' bytes
back, and the charge of a replayable stream's event log, which only the worker that wrote it can size.

The tally (keys.storage_tally) holds `bytes` and `items` in all and each member's bytes: r:<response id> (a
stored response: an item), s:<job id> (a resumable stream's request) and l:<job id> (its event log, charged when
the job ends, for as long as the log is kept). keys.storage_expiry scores each member by when it expires.
services.edge.store charges and refuses; this module only adds what was written already.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.protocol import bus, keys

log = logging.getLogger(__name__)

TRIM_BATCH = 256
"""Expired items a script takes off the tally at most per call: a long backlog drains over calls, and no single
call holds Redis for long."""
LOG_ENTRY_BYTES = 48
"""What Redis keeps per log entry beyond its events (its id and field, in the stream's listpack), roughly."""

TRIM_EXPIRED = """
local tally, expiry = KEYS[1], KEYS[2]
local gone = redis.call('ZRANGEBYSCORE', expiry, '-inf', ARGV[1], 'LIMIT', 0, TRIM_BATCH)
-- an item is a stored response, a conversation, a file or a batch (its record); a stream's request and its log, and
-- a batch's answers, count bytes only (a busy tenant streams thousands)
local function counted(member)
  local kind = string.sub(member, 1, 2)
  return (kind == 'r:' or kind == 'c:' or kind == 'f:' or kind == 'a:') and 1 or 0
end
for _, member in ipairs(gone) do
  local size = redis.call('HGET', tally, member)
  if size then
    redis.call('HINCRBY', tally, 'bytes', -tonumber(size))
    redis.call('HINCRBY', tally, 'items', -counted(member))
    redis.call('HDEL', tally, member)
  end
  redis.call('ZREM', expiry, member)
end
local held = tonumber(redis.call('HGET', tally, 'bytes') or '0')
local items = tonumber(redis.call('HGET', tally, 'items') or '0')
""".replace("TRIM_BATCH", str(TRIM_BATCH))

GIVE_BACK = """
-- after TRIM_EXPIRED, once a deleted item's keys are gone: its bytes (member ARGV[2]) leave the tally
local size = redis.call('HGET', tally, ARGV[2])
if size then
  redis.call('HSET', tally, 'bytes', held - tonumber(size), 'items', items - 1)
  redis.call('HDEL', tally, ARGV[2])
end
redis.call('ZREM', expiry, ARGV[2])
return 1
"""

_ADD_LOG = TRIM_EXPIRED + """
-- ARGV: now, member, bytes, expires at (ms). Added to what the member holds: a job a worker took over has its
-- log written by two
local member, size = ARGV[2], tonumber(ARGV[3])
local old = tonumber(redis.call('HGET', tally, member) or '0')
redis.call('HSET', tally, member, old + size, 'bytes', held + size)
redis.call('ZADD', expiry, 'GT', ARGV[4], member)
return held + size
"""


class LogCharges:
    """Charges the event logs of replayable streams to their tenants' storage, after the fact: a tenant whose
    logs filled its storage is refused its next resumable stream (services.edge.store.charge_stream)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._add = redis.register_script(_ADD_LOG)

    async def charge(self, job: bus.Job, size: int, kept_ms: int) -> None:
        """Adds `size` bytes written to the job's log, held for `kept_ms` from now (the log's own expiry)."""
        now = bus.now_ms()
        try:
            await self._add(keys=[keys.storage_tally(job.tenant), keys.storage_expiry(job.tenant)],
                            args=[now, f"l:{job.id}", size, now + kept_ms])
        except (RedisError, OSError) as exc:
            log.warning("could not charge the event log of job %s to its tenant's storage (%s)", job.id,
                        type(exc).__name__)
