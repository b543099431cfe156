"""An API key's limits, exact across every edge: one atomic, all-or-nothing admission step in Redis, and
the settlement of its reservation with the real usage when the job ends.

Requests and tokens per minute are GCRA (the generic cell rate algorithm): a key's state is one number,
the theoretical arrival time (TAT) of its next unit, and a unit is admitted when the TAT stays within a
minute of now. A burst of a whole minute's allowance is admitted at once; after it, units come back at
the steady rate (one request every 60/rpm seconds). Tokens are reserved at admission (the prompt estimate
plus the output budget) and settled by the worker that ends the job: the unused part is handed back.
Concurrency is a set of leases that expire unless their edge renews them, so a dead edge leaks nothing.
The quota is a counter per period. A request refused on any limit changes none of them.

Every key of one API key carries the hash tag {key id}: the scripts stay single-slot on a Redis Cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis

from shared.protocol import bus, keys
from shared.redisio.rawpipe import Arg
from shared.tenancy.apikeys import KeyRecord

WINDOW_MS = 60_000
USAGE_TTL_S = 400 * 24 * 3600
"""How long daily usage stays in Redis (a year and a month: enough for yearly reports)."""
SETTLED_TTL_MS = 3600 * 1000
"""Long enough for any two owners of one job to race on its end; short enough to cost little memory."""

_ADMIT = """
local now = tonumber(ARGV[1])
local rpm, tpm, tokens = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local max_concurrency, lease, lease_ttl = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local quota, quota_ttl, consume = tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10] == '1'
local requests = tonumber(ARGV[11])
local WINDOW = 60000
local refused, wait = '', 0
local function refuse(reason, ms)
  if refused == '' or ms > wait then refused, wait = reason, ms end
end
-- GCRA: the state after admitting `cost` units, and how far past the window that would be
local function gcra(key, limit, cost)
  local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
  local after = tat + cost * WINDOW / limit
  return tat, after, after - now - WINDOW
end
local r_tat, r_after, r_over, t_tat, t_after, t_over
if rpm > 0 then
  r_tat, r_after, r_over = gcra(KEYS[1], rpm, consume and requests or 0)
  if r_over > 0 then refuse('requests', r_over) end
end
if tpm > 0 then
  t_tat, t_after, t_over = gcra(KEYS[2], tpm, consume and tokens or 0)
  if consume and tokens > tpm then refuse('too_large', 0)
  elseif t_over > 0 then refuse('tokens', t_over) end
end
if max_concurrency > 0 and (lease ~= '' or not consume) then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if consume and redis.call('ZCARD', KEYS[3]) >= max_concurrency then refuse('concurrency', 1000) end
end
if quota > 0 and consume then
  local used = tonumber(redis.call('GET', KEYS[4])) or 0
  if used + tokens > quota then refused, wait = 'quota', 0 end
end
if refused == '' and consume then
  if rpm > 0 then redis.call('SET', KEYS[1], math.floor(r_after), 'PX', math.max(1, math.ceil(r_after - now))) end
  if tpm > 0 then redis.call('SET', KEYS[2], math.floor(t_after), 'PX', math.max(1, math.ceil(t_after - now))) end
  if max_concurrency > 0 and lease ~= '' then
    redis.call('ZADD', KEYS[3], now + lease_ttl, lease)
    redis.call('PEXPIRE', KEYS[3], lease_ttl)
  end
  if quota > 0 then
    redis.call('INCRBY', KEYS[4], tokens)
    redis.call('EXPIRE', KEYS[4], quota_ttl)
  end
end
local r_state, t_state = r_tat or now, t_tat or now
if refused == '' and consume then r_state, t_state = r_after or now, t_after or now end
local function remaining(state, limit)
  if limit <= 0 then return 0 end
  return math.max(0, math.floor((WINDOW - (state - now)) * limit / WINDOW + 1e-6))
end
return {refused, math.ceil(wait), math.ceil(r_state - now), math.ceil(t_state - now),
        remaining(r_state, rpm), remaining(t_state, tpm)}
"""

_SETTLE = """
if not redis.call('SET', KEYS[4], 1, 'NX', 'PX', ARGV[10]) then return 0 end
local now, reserved, used, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local refund = ARGV[12] == '1'
-- a state key that expired (the job ran longer than its reservation's minute) is "now": what the job used
-- beyond its reservation is still charged from now on
local function shift(key, units, limit)
  local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
  local after = math.max(tat + units * 60000 / limit, now)
  if after > now then
    redis.call('SET', key, math.floor(after), 'PX', math.max(1, math.ceil(after - now)))
  else
    redis.call('DEL', key)
  end
end
local delta = used - reserved
if tpm > 0 and delta ~= 0 then shift(KEYS[1], delta, tpm) end
if ARGV[11] == '1' and delta ~= 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('INCRBY', KEYS[2], delta)
end
if ARGV[13] ~= '' then redis.call('ZREM', KEYS[5], ARGV[13]) end
if refund then return 1 end
local counted = ARGV[6] .. '|' .. ARGV[14]  -- the model, and the lane's prefix (batch_ for batch work)
redis.call('HSET', KEYS[3], 'tenant', ARGV[5])
redis.call('HINCRBY', KEYS[3], counted .. 'requests', 1)
redis.call('HINCRBY', KEYS[3], counted .. 'prompt', ARGV[7])
redis.call('HINCRBY', KEYS[3], counted .. 'completion', ARGV[8])
redis.call('EXPIRE', KEYS[3], ARGV[9])
return 1
"""


@dataclass(frozen=True)
class Verdict:
    """What the admission step found: `refused` is "" when admitted, else the limit that refused."""

    refused: str
    wait_ms: int
    requests_reset_ms: int
    tokens_reset_ms: int
    requests_remaining: int = 0
    tokens_remaining: int = 0


@dataclass(frozen=True)
class Admission:
    """An admitted request: the headers its answer carries, and its concurrency lease (if the key has a
    concurrency limit)."""

    headers: dict[str, str] = field(default_factory=dict)
    lease: str = ""


def quota_ttl_s(record: KeyRecord, now: float) -> int:
    """Seconds until the quota period of `now` has ended, plus a day (the counter then goes by itself)."""
    return int(period_end(record, now) - now) + 24 * 3600


def period_end(record: KeyRecord, now: float) -> float:
    moment = datetime.fromtimestamp(now, UTC)
    if record.quota_period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        return (start + timedelta(days=1)).timestamp()
    start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (start.replace(year=start.year + 1, month=1) if start.month == 12
            else start.replace(month=start.month + 1)).timestamp()


def duration(ms: int) -> str:
    """A reset time as OpenAI writes it: 59ms, 6s, 1m30s."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = ms / 1000
    minutes, rest = divmod(seconds, 60)
    text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{text}" if minutes else text


def headers(record: KeyRecord, verdict: Verdict) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits the key has."""
    found: dict[str, str] = {}
    for kind, limit, reset_ms, remaining in (
            ("requests", record.rpm, verdict.requests_reset_ms, verdict.requests_remaining),
            ("tokens", record.tpm, verdict.tokens_reset_ms, verdict.tokens_remaining)):
        if limit:
            found[f"x-ratelimit-limit-{kind}"] = str(limit)
            found[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            found[f"x-ratelimit-reset-{kind}"] = duration(reset_ms)
    return found


class Limits:
    """The edge's side: admit a request for a key, peek at a key's state, renew and release leases."""

    def __init__(self, redis: aioredis.Redis, lease_ttl_s: float) -> None:
        self.redis = redis
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self._admit = redis.register_script(_ADMIT)

    async def check(self, record: KeyRecord, tokens: int, lease: str, consume: bool = True,
                    requests: int = 1) -> Verdict:
        """Runs the admission step: with `consume`, admits all or nothing (`requests` units of the rpm, `tokens`
        of the tpm and the quota, and the concurrency lease if `lease`); without, only reads the state."""
        now = time.time()
        window = record.quota_window(now) if record.quota_tokens else ""
        reply = await self._admit(
            keys=[keys.rate_requests(record.id), keys.rate_tokens(record.id), keys.leases(record.id),
                  keys.quota(record.id, window)],
            args=[int(now * 1000), record.rpm, record.tpm, tokens, record.max_concurrency, lease,
                  self.lease_ttl_ms, record.quota_tokens, quota_ttl_s(record, now), int(consume), requests])
        refused = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return Verdict(refused, int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4]), int(reply[5]))

    async def renew(self, leases: list[tuple[str, str]]) -> None:
        """Pushes the expiry of these (key id, lease) pairs a lease TTL ahead: the edge is alive."""
        if not leases:
            return
        expires = int(time.time() * 1000) + self.lease_ttl_ms
        pipe = self.redis.pipeline(transaction=False)
        for key_id, lease in leases:
            pipe.zadd(keys.leases(key_id), {lease: expires}, xx=True)
            pipe.pexpire(keys.leases(key_id), self.lease_ttl_ms)
        await pipe.execute()

    async def release(self, key_id: str, lease: str) -> None:
        await self.redis.zrem(keys.leases(key_id), lease)


class Settlements:
    """The end of a charge: settled with the real usage (by the worker that ends the job), or its tokens and lease
    refunded (by the edge, when the job could not even be queued)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._settle = redis.register_script(_SETTLE)

    async def settle(self, job: bus.Job, prompt_tokens: int, completion_tokens: int) -> bool:
        """Settles a job's reservation with what it used and adds that to the key's daily usage. Once per
        job, whoever calls it: False when it was settled already, or has no charge."""
        return await self._run(job, prompt_tokens, completion_tokens, refund=False)

    async def refund(self, job: bus.Job) -> bool:
        """Gives back a job's tokens and its lease: it never ran, and never will. Its request stays spent (taken
        before its body was read, as every refused request's is): were it given back, a key refused by the queue's
        bounds (tenant_queue_full, queue_full) could send requests as fast as it likes, each read, planned and
        admitted, however low its rpm."""
        return await self._run(job, 0, 0, refund=True)

    def command(self, job: bus.Job, prompt_tokens: int, completion_tokens: int) -> tuple[Arg, ...] | None:
        """`settle` as one raw command (EVALSHA), to ride in another write; None when the job has no charge. Its
        reply is the same; NoScriptError when Redis lost the script (`settle` loads it)."""
        found = self._keys_args(job, prompt_tokens, completion_tokens, refund=False)
        if found is None:
            return None
        script_keys, args = found
        return ("EVALSHA", self._settle.sha, len(script_keys), *script_keys, *args)

    async def _run(self, job: bus.Job, prompt_tokens: int, completion_tokens: int, refund: bool) -> bool:
        found = self._keys_args(job, prompt_tokens, completion_tokens, refund)
        if found is None:
            return False
        script_keys, args = found
        return bool(await self._settle(keys=script_keys, args=args))

    @staticmethod
    def _keys_args(job: bus.Job, prompt_tokens: int, completion_tokens: int,
                   refund: bool) -> tuple[list[str], list[Arg]] | None:
        charge = job.charge
        if charge is None:
            return None
        now = time.time()
        day = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d")
        return ([keys.rate_tokens(charge.key), keys.quota(charge.key, charge.quota_window or "-"),
                 keys.usage(charge.key, day), keys.settled(charge.key, job.id), keys.leases(charge.key)],
                [int(now * 1000), charge.tokens, prompt_tokens + completion_tokens, charge.tpm, job.tenant,
                 job.model, prompt_tokens, completion_tokens, USAGE_TTL_S, SETTLED_TTL_MS,
                 int(bool(charge.quota_window)), int(refund), charge.lease,
                 f"{charge.lane}_" if charge.lane else ""])
