"""The Lua functions every fair-share script starts with (shared.tenancy.fairshare_lua has the scripts, and the
sorted sets' encoding these functions keep): the keys' names, counters, offers and room, and cache-aware placement."""

from shared.protocol.keys import WORKER_GROUP

LIBRARY = r"""
local READY, BACKLOG, JOBS, COSTS, COUNTERS, QUEUED, STATE, SLOTS, INFLIGHT, AFFINITY, REQUESTS =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local GROUP = '@GROUP@'
-- a worker's prefix set and own stream share the model's hash tag (shared.protocol.keys.prefixes, worker_requests)
local PREFIXES = (string.gsub(REQUESTS, ':requests:', ':prefixes:', 1)) .. ":"
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

-- the sequences of a job, from its cost ('charge input_price output_price sequences'; one if absent)
local function sequences_of(cost)
  return tonumber(string.match(cost or '', '^%S+ %S+ %S+ (%d+)') or '1')
end

-- adds n to a count in a hash, and drops the field at 0 (so that jobs of one sequence leave no trace)
local function add(key, field, n)
  if n ~= 0 and redis.call('HINCRBY', key, field, n) <= 0 then redis.call('HDEL', key, field) end
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

-- a worker offers its slots, of which it keeps some as headroom, until ttl_ms from now; offers that expired
-- (their worker died) are dropped
local function offer(worker, slots, ttl_ms, headroom, now)
  if worker ~= '' then
    redis.call('HSET', SLOTS, worker, slots .. ' ' .. (now + tonumber(ttl_ms)) .. ' ' .. tonumber(headroom or '0'))
  end
end

local live = {}  -- the live workers (name, slots) as `capacity` found them this call
local expiry_of = {}  -- each live worker's offer's expiry (unix ms)

local function own_stream(worker)
  return REQUESTS .. ':' .. worker
end

-- the fields of the workers' consumer group on a stream (empty: no such stream or group)
local function group_of(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) ~= 'table' or groups.err then return {} end
  for _, group in ipairs(groups) do
    local fields = {}
    for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
    if fields.name == GROUP then return fields end
  end
  return {}
end

-- the live workers' slots, and their headroom
local function capacity(now)
  local total, headroom, offers = 0, 0, redis.call('HGETALL', SLOTS)
  live = {}
  for i = 1, #offers, 2 do
    local slots, expiry, kept = string.match(offers[i + 1], '^(%d+) (%d+) ?(%d*)$')
    if slots and tonumber(expiry) > now then
      total, headroom = total + tonumber(slots), headroom + (tonumber(kept) or 0)
      live[#live + 1] = {name = offers[i], slots = tonumber(slots)}
      expiry_of[offers[i]] = tonumber(expiry)
    else
      redis.call('HDEL', SLOTS, offers[i])
    end
  end
  return total, headroom
end

-- ms between two slots freeing up, from the moving average of a job's duration (0: unknown)
local function slot_interval(slots)
  local average = tonumber(redis.call('HGET', STATE, 'avg_ms') or '0')
  if slots <= 0 then return 0 end
  return average / slots
end

-- n jobs of a tenant's band in or out of its backlog, with what their sequences add beyond one each, and their bytes
local function count_queued(tenant, band, n, wide, bytes)
  add(QUEUED, tenant, n)
  add(QUEUED, tenant .. '\0bytes', bytes)
  redis.call('HINCRBY', STATE, 'queued', n)
  add(STATE, 'band:' .. band, n)
  add(STATE, 'wide:' .. band, wide)
  add(QUEUED, band .. tenant .. '\0', wide)
end

-- room on the live workers, in slots: their offers less the sequences of the jobs on the request stream (it holds
-- only jobs not yet acknowledged); with the offers and their headroom. An empty stream has no jobs in flight,
-- whatever a lost settle left.
local function room(now)
  local slots, headroom = capacity(now)
  local length = redis.call('XLEN', REQUESTS)
  for _, worker in ipairs(live) do length = length + redis.call('XLEN', own_stream(worker.name)) end
  if length == 0 then
    redis.call('HDEL', STATE, 'wide')
    redis.call('DEL', INFLIGHT)
  end
  return slots - length - math.max(0, tonumber(redis.call('HGET', STATE, 'wide') or '0')), slots, headroom
end

-- whether a job of `need` slots of a band and tenant may have them: the last `headroom` free slots only go to one
-- that holds fewer than that many, so that a tenant that comes in finds a slot at once however busy another is
local function fits(entity, need, free, headroom)
  if need > free then return false end
  return free - need >= headroom or tonumber(redis.call('HGET', INFLIGHT, entity) or '0') + need <= headroom
end

-- a job onto a request stream (the model's, or a worker's own); its sequences beyond the first join the wide count
local function send(job, entity, cost, stream)
  local sequences = sequences_of(cost)
  redis.call('XADD', stream or REQUESTS, '*', 'j', job, 'e', entity, 'c', cost)
  add(STATE, 'wide', sequences - 1)
  add(INFLIGHT, entity, sequences)
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

local placed = {cache = 0, waited = 0, expired = 0, none = 0}  -- this call's placements by reason, for the caller

-- each live worker's free slots: its offer less its entries pending on the model's stream and on its own (read
-- once a call, when a job has a prefix to place)
local free_of = nil
local function free_slots()
  if free_of then return free_of end
  free_of = {}
  local pending = {}
  local consumers = redis.pcall('XINFO', 'CONSUMERS', REQUESTS, GROUP)
  if type(consumers) == 'table' and not consumers.err then
    for _, consumer in ipairs(consumers) do
      local fields = {}
      for i = 1, #consumer, 2 do fields[consumer[i]] = consumer[i + 1] end
      if fields.name then pending[fields.name] = tonumber(fields.pending) or 0 end
    end
  end
  for _, worker in ipairs(live) do
    free_of[worker.name] = worker.slots - (pending[worker.name] or 0) - redis.call('XLEN', own_stream(worker.name))
  end
  return free_of
end

-- the live worker with room for `need` slots that holds the longest of the links (nil: none), how many it holds,
-- and the longest any busy worker holds
local function holder(links, need)
  local best, best_length, best_free, busy_length = nil, 0, 0, 0
  for name, free in pairs(free_slots()) do
    local held = redis.call('SMISMEMBER', PREFIXES .. name, unpack(links))
    local length = 0
    for i = #held, 1, -1 do
      if held[i] == 1 then length = i break end
    end
    if length > 0 and free >= need then
      if length > best_length or (length == best_length and free > best_free) then
        best, best_length, best_free = name, length, free
      end
    elseif length > busy_length then
      busy_length = length
    end
  end
  return best, best_length, busy_length
end

-- the live worker with the most free slots, at least `need` (nil: none has room), ties going to the first in the
-- rendezvous order of the chain's head; the links go into its set, so that the same prefix follows it before the
-- worker starts the job (the worker's summary takes them over then)
local function spread(links, need)
  local best, best_free, best_score = nil, nil, nil
  for name, free in pairs(free_slots()) do
    if free >= need then
      local score = redis.sha1hex(links[1] .. '\0' .. name)
      if not best or free > best_free or (free == best_free and score > best_score) then
        best, best_free, best_score = name, free, score
      end
    end
  end
  if not best then return nil end
  free_of[best] = free_of[best] - need
  local set = PREFIXES .. best
  redis.call('SADD', set, unpack(links))
  if redis.call('PTTL', set) < 0 then redis.call('PEXPIREAT', set, expiry_of[best]) end
  return best
end

-- the stream a job of `need` slots goes onto, from its affinity (see above); nil: it waits for a busy holder
local function place(affinity, need, now)
  local mark, bound, chain = string.match(affinity or '', '^(%a)(%d+) ?(.*)$')
  local links = {}
  for link in string.gmatch(chain or '', '%S+') do links[#links + 1] = link end
  if #links == 0 then
    placed.none = placed.none + 1
    return REQUESTS
  end
  local best, length, busy_length = holder(links, need)
  if busy_length > length and now < tonumber(bound) then return nil end
  if best then
    free_of[best] = free_of[best] - need
    local reason = mark == 'W' and 'waited' or 'cache'
    placed[reason] = placed[reason] + 1
    return own_stream(best)
  end
  local reason = busy_length > 0 and 'expired' or 'none'
  placed[reason] = placed[reason] + 1
  local spread_to = spread(links, need)
  return spread_to and own_stream(spread_to) or REQUESTS
end

-- what a script answers after its dispatched count: its placements by reason
local function placements()
  return {placed.cache, placed.waited, placed.expired, placed.none}
end

local WAITS, HELD_BACK = -1, -2

-- one job of the backlogged tenant with the least counter in the highest band, onto the request stream, if the
-- room takes all its sequences (all the slots, for one wider than the workers). Returns the slots it takes; WAITS:
-- it waits for more room, and nothing goes before it, so however wide it is, it waits only for slots to free;
-- HELD_BACK: only the headroom is left, and its tenant holds too much for it, or it waits for a busy worker that
-- holds its prefix (the next tenant may have it).
local function dispatch_one(head, room, slots, headroom, now)
  local band = head:sub(1, BAND_WIDTH)
  local counter = tonumber(head:sub(BAND_WIDTH + 1, BAND_WIDTH + COUNTER_WIDTH))
  local tenant = head:sub(BAND_WIDTH + COUNTER_WIDTH + 1)
  local entity = band .. tenant
  local member = oldest(entity)
  if not member then
    redis.call('ZREM', READY, head)
    return 0
  end
  local job, cost = redis.call('HGET', JOBS, member), redis.call('HGET', COSTS, member)
  local sequences = sequences_of(cost)
  local need = math.min(sequences, slots)
  if need > room then return WAITS end
  if not fits(entity, need, room, headroom) then return HELD_BACK end
  local affinity = redis.call('HGET', AFFINITY, member)
  local stream = place(affinity, need, now)
  if not stream then
    if affinity:sub(1, 1) == 'U' then redis.call('HSET', AFFINITY, member, 'W' .. affinity:sub(2)) end
    return HELD_BACK
  end
  if affinity then redis.call('HDEL', AFFINITY, member) end
  redis.call('ZREM', READY, head)
  redis.call('ZREM', BACKLOG, member)
  redis.call('HDEL', JOBS, member)
  redis.call('HDEL', COSTS, member)
  count_queued(tenant, band, -1, 1 - sequences, -(job and #job or 0))
  local served = counter_text(counter + tonumber(string.match(cost or '0', '^(%S+)')))
  redis.call('HSET', COUNTERS, entity, served)
  -- the level it was served at, not past its job's estimate: a settlement may give most of that back (a huge
  -- max_tokens that stopped early), and a tenant back from idle lifted to it would sit that far behind
  redis.call('HSET', STATE, 'last:' .. band, counter_text(counter))
  if oldest(entity) then redis.call('ZADD', READY, 0, band .. served .. tenant) end
  if not job then return 0 end
  send(job, entity, cost, stream)
  return sequences
end

-- work-conserving: while the live workers have room, anyone backlogged is served
local function dispatch(now)
  local free, slots, headroom = room(now)
  free = math.min(free, MOST_PER_CALL)
  local sent, passed = 0, 0
  while free > 0 do
    local head = redis.call('ZRANGEBYLEX', READY, '-', '+', 'LIMIT', passed, 1)[1]
    if not head then break end
    local taken = dispatch_one(head, free, slots, headroom, now)
    if taken == WAITS then break end
    if taken == HELD_BACK then
      passed = passed + 1
      if passed >= MOST_PER_CALL then break end  -- heads held back (or waiting for a holder) bound a call too
    else
      sent, free = sent + math.min(taken, 1), free - taken
    end
  end
  return sent
end
""".replace("@GROUP@", WORKER_GROUP)
