"""The fair-share scheduler's Lua scripts (see shared.fairshare for what they do; each takes the keys of
shared.keys.fair_keys, in that order). Each runs atomically, so edges and workers that call them at
once never see a half-moved job.

How the sorted sets encode order (every score is 0; members sort by name):
- a band is 4 digits, 1000 - priority: the highest priority sorts first;
- a counter is 24 characters, zero-padded with 3 decimals, so it sorts like the number it is;
- `ready` holds band .. counter .. tenant for each backlogged band and tenant: its first member is the next to
  serve (the highest band, in it the least counter);
- `backlog` holds band .. tenant .. NUL .. 16-digit sequence for each queued job: a tenant's jobs lie together,
  oldest first.
"""

_COMMON = r"""
local READY, BACKLOG, JOBS, COSTS, COUNTERS, QUEUED, STATE, SLOTS, REQUESTS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local BAND_WIDTH, COUNTER_WIDTH = 4, 24
local TIE = 0.001  -- the counters' resolution
local MOST_PER_CALL = 512  -- bounds how long one call holds Redis
local AVERAGE_WEIGHT = 0.1  -- of the newest job in the moving average of a job's duration

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- only differences between counters matter, so clamping at 0 loses nothing a tenant could notice
local function counter_text(value)
  return string.format('%024.3f', math.max(0, math.min(value, 1e19)))
end

local function first(key, from, to)
  return redis.call('ZRANGEBYLEX', key, from, to, 'LIMIT', 0, 1)[1]
end

local function oldest(entity)
  return first(BACKLOG, '[' .. entity .. '\0', '(' .. entity .. '\1')
end

local function band_range(band)
  return '[' .. band, '(' .. band .. '\255'
end

-- a worker offers its slots until ttl_ms from now; offers that expired (their worker died) are dropped
local function offer(worker, slots, ttl_ms, now)
  if worker ~= '' then
    redis.call('HSET', SLOTS, worker, slots .. ' ' .. (now + tonumber(ttl_ms)))
  end
end

local function capacity(now)
  local total, offers = 0, redis.call('HGETALL', SLOTS)
  for i = 1, #offers, 2 do
    local slots, expiry = string.match(offers[i + 1], '^(%d+) (%d+)$')
    if slots and tonumber(expiry) > now then
      total = total + tonumber(slots)
    else
      redis.call('HDEL', SLOTS, offers[i])
    end
  end
  return total
end

-- ms between two slots freeing up, from the moving average of a job's duration (0: unknown)
local function slot_interval(slots)
  local average = tonumber(redis.call('HGET', STATE, 'avg_ms') or '0')
  if slots <= 0 then return 0 end
  return average / slots
end

local function count_queued(tenant, band, n)
  if redis.call('HINCRBY', QUEUED, tenant, n) <= 0 then redis.call('HDEL', QUEUED, tenant) end
  redis.call('HINCRBY', STATE, 'queued', n)
  if redis.call('HINCRBY', STATE, 'band:' .. band, n) <= 0 then redis.call('HDEL', STATE, 'band:' .. band) end
end

local function set_counter(entity, value)
  local band, tenant = entity:sub(1, BAND_WIDTH), entity:sub(BAND_WIDTH + 1)
  local old, new = redis.call('HGET', COUNTERS, entity), counter_text(value)
  if old and redis.call('ZREM', READY, band .. old .. tenant) == 1 then
    redis.call('ZADD', READY, 0, band .. new .. tenant)
  end
  redis.call('HSET', COUNTERS, entity, new)
  return new
end

-- one job of the backlogged tenant with the least counter in the highest band, onto the request stream
local function dispatch_one(head)
  local band = head:sub(1, BAND_WIDTH)
  local counter = tonumber(head:sub(BAND_WIDTH + 1, BAND_WIDTH + COUNTER_WIDTH))
  local tenant = head:sub(BAND_WIDTH + COUNTER_WIDTH + 1)
  local entity = band .. tenant
  redis.call('ZREM', READY, head)
  local member = oldest(entity)
  if not member then return 0 end
  local job, cost = redis.call('HGET', JOBS, member), redis.call('HGET', COSTS, member)
  redis.call('ZREM', BACKLOG, member)
  redis.call('HDEL', JOBS, member)
  redis.call('HDEL', COSTS, member)
  count_queued(tenant, band, -1)
  local served = counter_text(counter + tonumber(string.match(cost or '0', '^(%S+)')))
  redis.call('HSET', COUNTERS, entity, served)
  redis.call('HSET', STATE, 'last:' .. band, served)
  if oldest(entity) then redis.call('ZADD', READY, 0, band .. served .. tenant) end
  if not job then return 0 end
  redis.call('XADD', REQUESTS, '*', 'j', job, 'e', entity, 'c', cost)
  return 1
end

-- work-conserving: while the live workers have room (their slots, less the jobs on the request stream, which
-- holds only jobs not yet acknowledged), anyone backlogged is served
local function dispatch(now)
  local room = math.min(capacity(now) - redis.call('XLEN', REQUESTS), MOST_PER_CALL)
  local sent = 0
  while room > 0 do
    local head = first(READY, '-', '+')
    if not head then break end
    local moved = dispatch_one(head)
    sent, room = sent + moved, room - moved
  end
  return sent
end
"""

ENQUEUE = _COMMON + r"""
-- ARGV: tenant, band, cost ('charge input_price output_price'), job, max jobs queued, max queued per tenant,
-- the wait the job can afford (ms). Returns {'ok', backlog member, jobs dispatched} or {refusal, retry in ms}.
local tenant, band, cost, job = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local max_jobs, max_mine, affordable = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local entity = band .. tenant
local now = now_ms()
local slots = capacity(now)
local interval = slot_interval(slots)
local total = tonumber(redis.call('HGET', STATE, 'queued') or '0')
if total >= max_jobs then
  return {'queue_full', math.ceil((total - max_jobs + 1) * interval)}
end
local room = slots - redis.call('XLEN', REQUESTS)
if total == 0 and room > 0 and max_mine > 0 and affordable >= 0 then
  -- nobody is backlogged and a slot is free: the job goes straight onto the request stream (no backlog entry,
  -- so no member to withdraw), its tenant's counter moving exactly as the way through the backlog would move it
  local charge = tonumber(string.match(cost, '^(%S+)'))
  local own = tonumber(redis.call('HGET', COUNTERS, entity) or '0')
  local lifted = tonumber(counter_text(math.max(own, tonumber(redis.call('HGET', STATE, 'last:' .. band) or '0'))))
  local served = counter_text(lifted + charge)
  redis.call('HSET', COUNTERS, entity, served)
  redis.call('HSET', STATE, 'last:' .. band, served)
  redis.call('XADD', REQUESTS, '*', 'j', job, 'e', entity, 'c', cost)
  return {'ok', '', 1}
end
local backlogged = oldest(entity) ~= nil
local rivals = redis.call('ZLEXCOUNT', READY, band_range(band)) - (backlogged and 1 or 0)
local mine = tonumber(redis.call('HGET', QUEUED, tenant) or '0')
if mine >= max_mine then
  return {'tenant_queue_full', math.ceil((mine - max_mine + 1) * (rivals + 1) * interval)}
end
-- jobs served before this one: every job of a higher band; in its own band its tenant's queued jobs, and
-- about as many of each rival's (the counters take turns)
local ahead = 0
local state = redis.call('HGETALL', STATE)
for i = 1, #state, 2 do
  local other = string.match(state[i], '^band:(%d+)$')
  if other and other < band then ahead = ahead + tonumber(state[i + 1]) end
end
local queued_here = redis.call('ZLEXCOUNT', BACKLOG, '[' .. entity .. '\0', '(' .. entity .. '\1')
local in_band = tonumber(redis.call('HGET', STATE, 'band:' .. band) or '0')
ahead = ahead + queued_here + math.min(in_band - queued_here, (queued_here + 1) * rivals)
local wait = math.max(0, ahead + 1 - room) * interval
if wait > affordable then
  return {'wait_exceeds_deadline', math.ceil(wait - affordable)}
end
local member = entity .. '\0' .. string.format('%016d', redis.call('HINCRBY', STATE, 'seq', 1))
redis.call('ZADD', BACKLOG, 0, member)
redis.call('HSET', JOBS, member, job)
redis.call('HSET', COSTS, member, cost)
count_queued(tenant, band, 1)
if not backlogged then
  -- back from idle: its counter rises to the least of its band's backlogged tenants (or the last one served),
  -- so idle time is not saved up into a burst; a tie goes to it, the tenant served least recently
  local floor = first(READY, band_range(band))
  if floor then
    floor = tonumber(floor:sub(BAND_WIDTH + 1, BAND_WIDTH + COUNTER_WIDTH)) - TIE
  else
    floor = tonumber(redis.call('HGET', STATE, 'last:' .. band) or '0')
  end
  local own = redis.call('HGET', COUNTERS, entity) or '0'
  local lifted = counter_text(math.max(tonumber(own), floor))
  redis.call('HSET', COUNTERS, entity, lifted)
  redis.call('ZADD', READY, 0, band .. lifted .. tenant)
end
return {'ok', member, dispatch(now)}
"""

DISPATCH = _COMMON + r"""
-- ARGV: the offering worker ('' for none), its slots, how long its offer holds (ms), then for each job that
-- ended: its band and tenant, the correction of its counter, how long it ran (ms). Returns jobs dispatched.
local now = now_ms()
offer(ARGV[1], ARGV[2], ARGV[3], now)
for i = 4, #ARGV, 3 do
  local entity, correction, duration = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local counter = redis.call('HGET', COUNTERS, entity)
  if counter and correction ~= 0 then set_counter(entity, tonumber(counter) + correction) end
  if duration > 0 then
    local average = tonumber(redis.call('HGET', STATE, 'avg_ms') or '0')
    average = average == 0 and duration or average + (duration - average) * AVERAGE_WEIGHT
    redis.call('HSET', STATE, 'avg_ms', string.format('%.1f', average))
  end
end
return dispatch(now)
"""

ENQUEUE_FIFO = _COMMON + r"""
-- ARGV: job, max jobs queued, the wait the job can afford (ms), the workers' consumer group. No backlogs: the
-- job goes straight onto the request stream, whose entries not yet delivered are the queue.
local job, max_jobs, affordable, group = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local now = now_ms()
local slots = capacity(now)
local interval = slot_interval(slots)
local summary = redis.pcall('XPENDING', REQUESTS, group)
local delivered = (type(summary) == 'table' and tonumber(summary[1])) or 0
local queued = redis.call('XLEN', REQUESTS) - delivered
if queued >= max_jobs then
  return {'queue_full', math.ceil((queued - max_jobs + 1) * interval)}
end
local wait = math.max(0, queued + 1 - (slots - delivered)) * interval
if wait > affordable then
  return {'wait_exceeds_deadline', math.ceil(wait - affordable)}
end
redis.call('XADD', REQUESTS, '*', 'j', job)
return {'ok', '', 0}
"""

WITHDRAW = _COMMON + r"""
-- ARGV: a backlog member (what enqueue answered). Takes a job whose client went away off its tenant's backlog,
-- if it is still there. Returns 1 if it was.
local member = ARGV[1]
if redis.call('ZREM', BACKLOG, member) == 0 then return 0 end
local entity = member:sub(1, member:find('\0', 1, true) - 1)
local band, tenant = entity:sub(1, BAND_WIDTH), entity:sub(BAND_WIDTH + 1)
redis.call('HDEL', JOBS, member)
redis.call('HDEL', COSTS, member)
count_queued(tenant, band, -1)
if not oldest(entity) then
  local counter = redis.call('HGET', COUNTERS, entity)
  if counter then redis.call('ZREM', READY, band .. counter .. tenant) end
end
return 1
"""
