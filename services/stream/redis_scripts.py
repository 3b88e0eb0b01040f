"""The Lua scripts of the Redis backend (services/stream/redis_backend.py, whose docstring says what the
keys hold): each checks and writes one buffer atomically across stream-service replicas."""

NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: meta, stream, leases. ARGV: owner, metadata, open_ttl_ms, gen, lease_ms, key.
CREATE = (
    NOW
    + """
if redis.call('HGET', KEYS[1], 'deleted') == '1' then redis.call('DEL', KEYS[1]) end
local closed = redis.call('HGET', KEYS[1], 'closed')
if closed == '0' then return 'open' end
if closed and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 'foreign' end
redis.call('DEL', KEYS[1])
local now = now_ms()
local begin = tostring(now) .. '-0'
if redis.call('EXISTS', KEYS[2]) == 1 then
  -- the new buffer's first id is above the old one's last (written in this millisecond, or past it)
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
  if last then
    local ms, seq = string.match(last[1], '^(%d+)%-(%d+)$')
    if tonumber(ms) >= now then begin = ms .. '-' .. tostring(tonumber(seq) + 1) end
  end
  redis.call('XTRIM', KEYS[2], 'MAXLEN', 0)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'metadata', ARGV[2], 'closed', '0', 'gen', ARGV[4],
  'begin', begin)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[6])
return 'ok'
"""
)

# A write's `since` against the buffer's `begin`: both as 40 digits (ms, then seq, each zero-padded to
# 20), which order as the entry ids do (Lua's numbers are exact only to 2^53). Returns 'replaced' when
# `since` (ARGV[n], padded by the caller) is an earlier buffer's.
SINCE = """
local function replaced(meta, since)
  if since == '' then return false end
  local begin = redis.call('HGET', meta, 'begin')
  if not begin then return false end
  local ms, seq = string.match(begin, '^(%d+)%-(%d+)$')
  return since < string.rep('0', 20 - #ms) .. ms .. string.rep('0', 20 - #seq) .. seq
end
"""

# KEYS: meta, stream, leases. ARGV: max_events, open_ttl_ms, writer, lease_ms, key, since, producer,
# sequence, payloads... A producer's count of events held is the meta field `p:<producer>`: the events of
# a batch sent again that the buffer holds are skipped (answered '').
APPEND = (
    NOW
    + SINCE
    + """
local closed = redis.call('HGET', KEYS[1], 'closed')
if not closed or redis.call('HGET', KEYS[1], 'deleted') == '1' then
  if ARGV[6] ~= '' then return {'replaced'} end
  return {'missing'}
end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then return {'missing'} end
if replaced(KEYS[1], ARGV[6]) then return {'replaced'} end
if closed == '1' then return {'closed'} end
local held = 0
if ARGV[7] ~= '' then
  local count = tonumber(redis.call('HGET', KEYS[1], 'p:' .. ARGV[7]) or '0')
  held = count - tonumber(ARGV[8])
  if held < 0 then return {'gap', tostring(count)} end
end
local first = 9 + held
local n = redis.call('XLEN', KEYS[2])
local out = {'full', tostring(n)}
if n + #ARGV - first + 1 <= tonumber(ARGV[1]) then
  out = {'ok'}
  local gen = redis.call('HGET', KEYS[1], 'gen')
  for i = 9, math.min(first - 1, #ARGV) do out[#out + 1] = '' end
  for i = first, #ARGV do out[#out + 1] = redis.call('XADD', KEYS[2], '*', 'e', ARGV[i], 'g', gen) end
  if ARGV[7] ~= '' and #ARGV >= first then
    redis.call('HSET', KEYS[1], 'p:' .. ARGV[7], tonumber(ARGV[8]) + #ARGV - 8)
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], now_ms() + tonumber(ARGV[4]), ARGV[5])
return out
"""
)

# KEYS: meta, stream, leases. ARGV: terminal, ttl_ms, writer, key, since.
CLOSE = (
    SINCE
    + """
local closed = redis.call('HGET', KEYS[1], 'closed')
if not closed or redis.call('HGET', KEYS[1], 'deleted') == '1' then return {'missing'} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then return {'missing'} end
if replaced(KEYS[1], ARGV[5]) then return {'replaced'} end
if closed == '1' then return {'closed', redis.call('HGET', KEYS[1], 'close_offset')} end
local id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[1], 'g', redis.call('HGET', KEYS[1], 'gen'))
redis.call('HSET', KEYS[1], 'closed', '1', 'close_offset', id)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[4])
return {'ok', id}
"""
)

# Deleting a buffer: closed (when open) and marked deleted, which every other script and read treats as
# missing; both keys live on for DRAIN_MS so followers read the terminal event, then Redis drops them.
# KEYS: meta, stream, leases. ARGV: requester, terminal, drain_ms, key.
DELETE = """
local closed = redis.call('HGET', KEYS[1], 'closed')
if not closed or redis.call('HGET', KEYS[1], 'deleted') == '1' then return 0 end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if closed == '0' then
  local id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[2], 'g', redis.call('HGET', KEYS[1], 'gen'))
  redis.call('HSET', KEYS[1], 'closed', '1', 'close_offset', id)
end
redis.call('HSET', KEYS[1], 'deleted', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[4])
return 1
"""

# Lease renewals of open buffers. KEYS: leases. ARGV: prefix, lease_ms, open_ttl_ms, keys...
RENEW = (
    NOW
    + """
local renewed = 0
local deadline = now_ms() + tonumber(ARGV[2])
for i = 4, #ARGV do
  local meta = ARGV[1] .. 'meta:' .. ARGV[i]
  if redis.call('HGET', meta, 'closed') == '0' and redis.call('HGET', meta, 'deleted') ~= '1' then
    redis.call('ZADD', KEYS[1], deadline, ARGV[i])
    redis.call('PEXPIRE', meta, ARGV[3])
    redis.call('PEXPIRE', ARGV[1] .. 'stream:' .. ARGV[i], ARGV[3])
    renewed = renewed + 1
  end
end
return renewed
"""
)

# Ends the open buffers whose lease expired (their writer died) with the terminal event; any replica
# may run it, the script makes each end happen once. KEYS: leases. ARGV: prefix, limit, terminal, ttl_ms.
SWEEP = (
    NOW
    + """
local ended = {}
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[2]))) do
  redis.call('ZREM', KEYS[1], key)
  local meta, stream = ARGV[1] .. 'meta:' .. key, ARGV[1] .. 'stream:' .. key
  if redis.call('HGET', meta, 'closed') == '0' then
    local id = redis.call('XADD', stream, '*', 'e', ARGV[3], 'g', redis.call('HGET', meta, 'gen'))
    redis.call('HSET', meta, 'closed', '1', 'close_offset', id)
    redis.call('PEXPIRE', meta, ARGV[4])
    redis.call('PEXPIRE', stream, ARGV[4])
    ended[#ended + 1] = key
  end
end
return ended
"""
)
