"""The fair-share scheduler's Lua scripts (see shared.tenancy.fairshare for what they do; each takes the keys of
shared.protocol.keys.fair_keys, in that order). Each runs atomically, so edges and workers that call them at
once never see a half-moved job.

How the sorted sets encode order (every score is 0; members sort by name):
- a band is 4 digits, 1000 - priority: the highest priority sorts first;
- a counter is 24 characters, zero-padded with 3 decimals, so it sorts like the number it is;
- `ready` holds band .. counter .. tenant for each backlogged band and tenant: its first member is the next to
  serve (the highest band, in it the least counter);
- `backlog` holds band .. tenant .. NUL .. 16-digit sequence for each queued job: a tenant's jobs lie together,
  oldest first.

Slots count engine sequences, and a job takes as many as it runs (its cost's fourth field). Counts of jobs are
kept as they were; what jobs of several sequences add beyond one slot each ("wide") is kept beside them, only while
there is any: in `state` for the request stream (`wide`) and each band (`wide:` .. band), in `queued` for each band
and tenant (band .. tenant .. NUL).

Cache-aware dispatch (docs/cache-aware-dispatch.md): a queued job's `affinity` is 'U' (or 'W' once it waited), the
time (unix ms) until which it may wait for a busy worker holding its prompt prefix, then its prefix chain's links.
A job goes onto the own stream of the live worker with free slots that holds the longest of its links (reason
`cache`, or `waited`), else, while its bound lasts and a busy worker holds a longer one, it waits (the next tenant
fairness allows goes first), else onto the own stream of the worker with the most free slots, ties going to the
first in its chain head's rendezvous order, its links added to that worker's set so that the same prefix follows it
(reasons `expired`: a holder was busy past the bound; `none`: nobody holds it), else onto the model's stream. A
worker's free slots are its offer less its entries pending on the model's stream and its own stream's length; the
room counts every live worker's stream.
"""

from shared.tenancy.fairshare_lua_library import LIBRARY

ENQUEUE = LIBRARY + r"""
-- ARGV: tenant, band, cost ('charge input_price output_price'), job, max jobs queued, max queued per tenant,
-- the wait the job can afford (ms), max bytes queued per tenant (0: none), its affinity ('' or the longest it may
-- wait for a busy worker holding its prefix, in ms, then its prefix links). Returns {'ok', backlog member, jobs
-- dispatched, placements by reason...} or {refusal, retry in ms}.
local tenant, band, cost, job = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local max_jobs, max_mine, affordable = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local max_bytes = tonumber(ARGV[8] or '0')
local entity = band .. tenant
local affinity = ''
local wait_ms, chain = string.match(ARGV[9] or '', '^(%d+) (.+)$')
if chain then affinity = 'U' .. (now_ms() + tonumber(wait_ms)) .. ' ' .. chain end
local now = now_ms()
local free, slots, headroom = room(now)
local interval = slot_interval(slots)
local sequences = sequences_of(cost)
local need = math.min(sequences, slots)
local total = tonumber(redis.call('HGET', STATE, 'queued') or '0')
if total >= max_jobs then
  return {'queue_full', math.ceil((total - max_jobs + 1) * interval)}
end
local stream = nil
if total == 0 and need > 0 and fits(entity, need, free, headroom) and max_mine > 0 and affordable >= 0 then
  stream = place(affinity, need, now)  -- nil: it waits for a busy worker that holds its prefix
end
if stream then
  -- nobody is backlogged and a slot is free: the job goes straight onto a request stream (no backlog entry,
  -- so no member to withdraw), its tenant's counter moving exactly as the way through the backlog would move it
  local charge = tonumber(string.match(cost, '^(%S+)'))
  local own = tonumber(redis.call('HGET', COUNTERS, entity) or '0')
  local lifted = tonumber(counter_text(math.max(own, tonumber(redis.call('HGET', STATE, 'last:' .. band) or '0'))))
  local served = counter_text(lifted + charge)
  redis.call('HSET', COUNTERS, entity, served)
  redis.call('HSET', STATE, 'last:' .. band, counter_text(lifted))  -- the level it was served at (see dispatch_one)
  send(job, entity, cost, stream)
  return {'ok', '', 1, unpack(placements())}
end
local backlogged = oldest(entity) ~= nil
local rivals = redis.call('ZLEXCOUNT', READY, band_range(band)) - (backlogged and 1 or 0)
local mine = tonumber(redis.call('HGET', QUEUED, tenant) or '0')
local mine_bytes = tonumber(redis.call('HGET', QUEUED, tenant .. '\0bytes') or '0')
if mine >= max_mine or (max_bytes > 0 and mine > 0 and mine_bytes + #job > max_bytes) then
  return {'tenant_queue_full', math.ceil((mine - math.min(mine, max_mine) + 1) * (rivals + 1) * interval)}
end
-- slots taken before this job's: every queued job's of a higher band; in its own band its tenant's queued jobs', and
-- about as many of each rival's (the counters take turns)
local ahead = 0
local state = redis.call('HGETALL', STATE)
for i = 1, #state, 2 do
  local kind, other = string.match(state[i], '^(%a+):(%d+)$')
  if other and other < band and (kind == 'band' or kind == 'wide') then ahead = ahead + tonumber(state[i + 1]) end
end
local queued_here = redis.call('ZLEXCOUNT', BACKLOG, '[' .. entity .. '\0', '(' .. entity .. '\1')
  + tonumber(redis.call('HGET', QUEUED, entity .. '\0') or '0')
local in_band = tonumber(redis.call('HGET', STATE, 'band:' .. band) or '0')
  + tonumber(redis.call('HGET', STATE, 'wide:' .. band) or '0')
ahead = ahead + queued_here + math.min(in_band - queued_here, (queued_here + sequences) * rivals)
local wait = math.max(0, ahead + need - free) * interval
if wait > affordable then
  return {'wait_exceeds_deadline', math.ceil(wait - affordable)}
end
local member = entity .. '\0' .. string.format('%016d', redis.call('HINCRBY', STATE, 'seq', 1))
redis.call('ZADD', BACKLOG, 0, member)
redis.call('HSET', JOBS, member, job)
redis.call('HSET', COSTS, member, cost)
if affinity ~= '' then redis.call('HSET', AFFINITY, member, affinity) end
count_queued(tenant, band, 1, sequences - 1, #job)
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
local sent = dispatch(now)
return {'ok', member, sent, unpack(placements())}
"""

DISPATCH = LIBRARY + r"""
-- ARGV: the offering worker ('' for none), its slots, how long its offer holds (ms), its headroom, then for each
-- job that ended: its band and tenant, the correction of its counter, how long it ran (ms), its sequences (its
-- entry left the request stream). Returns {jobs dispatched, placements by reason...}.
local now = now_ms()
offer(ARGV[1], ARGV[2], ARGV[3], ARGV[4], now)
for i = 5, #ARGV, 4 do
  local entity, correction, duration = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local sequences = tonumber(ARGV[i + 3])
  add(STATE, 'wide', 1 - sequences)
  add(INFLIGHT, entity, -sequences)
  local counter = redis.call('HGET', COUNTERS, entity)
  if counter and correction ~= 0 then set_counter(entity, tonumber(counter) + correction) end
  if duration > 0 then
    local average = tonumber(redis.call('HGET', STATE, 'avg_ms') or '0')
    average = average == 0 and duration or average + (duration - average) * AVERAGE_WEIGHT
    redis.call('HSET', STATE, 'avg_ms', string.format('%.1f', average))
  end
end
local sent = dispatch(now)
return {sent, unpack(placements())}
"""

ENQUEUE_FIFO = LIBRARY + r"""
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

WITHDRAW = LIBRARY + r"""
-- ARGV: a backlog member (what enqueue answered). Takes a job whose client went away off its tenant's backlog,
-- if it is still there. Returns 1 if it was.
local member = ARGV[1]
if redis.call('ZREM', BACKLOG, member) == 0 then return 0 end
local entity = member:sub(1, member:find('\0', 1, true) - 1)
local band, tenant = entity:sub(1, BAND_WIDTH), entity:sub(BAND_WIDTH + 1)
local cost = redis.call('HGET', COSTS, member)
local bytes = redis.call('HSTRLEN', JOBS, member)
redis.call('HDEL', JOBS, member)
redis.call('HDEL', COSTS, member)
redis.call('HDEL', AFFINITY, member)
count_queued(tenant, band, -1, 1 - sequences_of(cost), -bytes)
if not oldest(entity) then
  local counter = redis.call('HGET', COUNTERS, entity)
  if counter then redis.call('ZREM', READY, band .. counter .. tenant) end
end
return 1
"""

HAND_OVER = LIBRARY + r"""
-- ARGV: the stream a job's entry is on, its id, its affinity as the enqueue takes it ('' or '0 ' then its prefix
-- links), the calling worker, then the fields of its new entry. A draining worker puts the job back for another
-- worker to continue: onto the own stream of a live worker with room that holds its prefix, else onto the model's
-- stream, and lets go of its entry, in one step. Returns the placements by reason; false, doing nothing, when the
-- entry is no longer the caller's (another worker claimed it meanwhile: the job is that worker's to continue).
local from, entry, caller = ARGV[1], ARGV[2], ARGV[4]
local held = redis.call('XPENDING', from, GROUP, entry, entry, 1)
if #held == 0 or held[1][2] ~= caller then return false end
local now = now_ms()
capacity(now)
local wait_ms, chain = string.match(ARGV[3], '^(%d+) (.+)$')
local stream = place(chain and ('U' .. now .. ' ' .. chain) or '', 1, now) or REQUESTS
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', stream, '*', unpack(fields))
redis.call('XACK', from, GROUP, entry)
redis.call('XDEL', from, entry)
return placements()
"""

RESCUE = LIBRARY + r"""
-- ARGV: the set of the model's workers with a stream of their own (shared.protocol.keys.worker_streams), the calling
-- worker, the idle time (ms) past which a read entry's worker stopped beating. Moves to the model's stream the
-- entries of workers' own streams that would otherwise wait on a dead worker: those read by a worker that stopped
-- beating (marked `m`: whoever reads them continues them from their logs, as a claim does) and those never read
-- on the stream of a worker that no longer offers slots (stopped or dead); a dead worker's stream, once empty, goes.
-- At most 100 entries a stream a call. Returns the entries moved.
local registry, caller, min_idle = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
capacity(now)
local offering = {}
for _, worker in ipairs(live) do offering[worker.name] = true end
local moved = 0

local function move(stream, entry, fields, reclaimed)
  if fields then
    if reclaimed then
      fields[#fields + 1] = 'm'
      fields[#fields + 1] = '1'
    end
    redis.call('XADD', REQUESTS, '*', unpack(fields))
    moved = moved + 1
  end
  redis.call('XACK', stream, GROUP, entry)
  redis.call('XDEL', stream, entry)
end

local function last_read(stream)
  return group_of(stream)['last-delivered-id'] or '0-0'
end

for _, worker in ipairs(redis.call('SMEMBERS', registry)) do
  local stream = own_stream(worker)
  if worker ~= caller then
    local stale = redis.pcall('XPENDING', stream, GROUP, 'IDLE', min_idle, '-', '+', 100)
    if type(stale) == 'table' and not stale.err then
      for _, pending in ipairs(stale) do
        local found = redis.call('XRANGE', stream, pending[1], pending[1])[1]
        move(stream, pending[1], found and found[2], true)
      end
    end
  end
  if not offering[worker] then
    for _, entry in ipairs(redis.call('XRANGE', stream, '(' .. last_read(stream), '+', 'COUNT', 100)) do
      move(stream, entry[1], entry[2], false)
    end
    if worker ~= caller and redis.call('XLEN', stream) == 0 then
      redis.call('DEL', stream)
      redis.call('SREM', registry, worker)
    end
  end
end
return moved
"""

QUEUE_FIGURES = LIBRARY + r"""
-- ARGV: the set of the model's workers with a stream of their own (shared.protocol.keys.worker_streams). The model's
-- queue as its gauges show it, over its stream and every worker's own: {jobs in the backlogs, entries on the
-- streams, entries read and not yet acknowledged, entries no worker has read}. Writes nothing.
local streams = {REQUESTS}
for _, worker in ipairs(redis.call('SMEMBERS', ARGV[1])) do streams[#streams + 1] = own_stream(worker) end
local length, pending, lag = 0, 0, 0
for _, stream in ipairs(streams) do
  local group = group_of(stream)
  length = length + redis.call('XLEN', stream)
  pending, lag = pending + (tonumber(group.pending) or 0), lag + (tonumber(group.lag) or 0)
end
return {tonumber(redis.call('HGET', STATE, 'queued') or '0'), length, pending, lag}
"""
