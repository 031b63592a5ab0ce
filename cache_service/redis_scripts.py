"""Lua scripts that keep the Redis host-cache index consistent across replicas.

Redis runs a script atomically, so eviction, publication and recency updates
never interleave with another replica's. Keys hang off one base
`<prefix>:<fingerprint>`:
  :cur    hash  task id -> current version
  :size   hash  task id -> weight bytes
  :lru    zset  task id -> tick of last use (lowest = least recently used)
  :used   int   bytes of all current versions
  :tick   int   logical clock for :lru
  :time   hash  task id -> last use, unix seconds
  :stats  hash  hits, misses, evictions
  :blob:<task>:<version>  the weight bytes
  :meta:<task>:<version>  the AdapterRecord as JSON
Retired versions (evicted or replaced) are not deleted but expire after a
grace period, so a reader already streaming one finishes on it. Keys are built
inside the scripts, which standalone Redis allows (not Redis Cluster).
"""

# Shared helper: remove a task's current version from the index, let its bytes expire.
_RETIRE = """
local function retire(base, task, grace_ms)
  local ver = redis.call('HGET', base .. ':cur', task)
  if not ver then return 0 end
  local size = tonumber(redis.call('HGET', base .. ':size', task) or '0')
  redis.call('HDEL', base .. ':cur', task)
  redis.call('HDEL', base .. ':size', task)
  redis.call('HDEL', base .. ':time', task)
  redis.call('ZREM', base .. ':lru', task)
  redis.call('DECRBY', base .. ':used', size)
  redis.call('PEXPIRE', base .. ':blob:' .. task .. ':' .. ver, grace_ms)
  redis.call('PEXPIRE', base .. ':meta:' .. task .. ':' .. ver, grace_ms)
  return 1
end
local function touch(base, task, now)
  redis.call('ZADD', base .. ':lru', redis.call('INCR', base .. ':tick'), task)
  redis.call('HSET', base .. ':time', task, now)
end
"""

# ARGV: base, tmp key, task, version, num bytes, budget, record json, replace, grace ms, now
# -> {0, evicted...} stored | {1} same version kept | {2, current} exists | {3} too big | {4} upload expired
COMMIT = _RETIRE + """
local base, tmp, task, ver = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nbytes, budget = tonumber(ARGV[5]), tonumber(ARGV[6])
local replace, grace, now = ARGV[8], tonumber(ARGV[9]), ARGV[10]
local cur = redis.call('HGET', base .. ':cur', task)
if cur == ver then
  redis.call('DEL', tmp)
  touch(base, task, now)
  return {1}
end
if cur and replace ~= '1' then
  redis.call('DEL', tmp)
  return {2, cur}
end
if nbytes > budget then
  redis.call('DEL', tmp)
  return {3}
end
if redis.call('EXISTS', tmp) == 0 then return {4} end
if cur then retire(base, task, grace) end
local result = {0}
local used = tonumber(redis.call('GET', base .. ':used') or '0')
while used + nbytes > budget do
  local victim = redis.call('ZRANGE', base .. ':lru', 0, 0)[1]
  if not victim then break end
  retire(base, victim, grace)
  redis.call('HINCRBY', base .. ':stats', 'evictions', 1)
  table.insert(result, victim)
  used = tonumber(redis.call('GET', base .. ':used') or '0')
end
local blob = base .. ':blob:' .. task .. ':' .. ver
redis.call('RENAME', tmp, blob)
redis.call('PERSIST', blob)
redis.call('SET', base .. ':meta:' .. task .. ':' .. ver, ARGV[7])
redis.call('HSET', base .. ':cur', task, ver)
redis.call('HSET', base .. ':size', task, nbytes)
redis.call('INCRBY', base .. ':used', nbytes)
touch(base, task, now)
return result
"""

# ARGV: base, task, wanted version ('' = any), now -> {1, version, record json} | {0, current or ''}
GET = _RETIRE + """
local base, task, want, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local cur = redis.call('HGET', base .. ':cur', task)
if (not cur) or (want ~= '' and want ~= cur) then
  redis.call('HINCRBY', base .. ':stats', 'misses', 1)
  return {0, cur or ''}
end
local meta = redis.call('GET', base .. ':meta:' .. task .. ':' .. cur)
if not meta then
  redis.call('HINCRBY', base .. ':stats', 'misses', 1)
  return {0, ''}
end
redis.call('HINCRBY', base .. ':stats', 'hits', 1)
touch(base, task, now)
return {1, cur, meta}
"""

# ARGV: base, task, grace ms -> 1 evicted | 0 absent
EVICT = _RETIRE + """
return retire(ARGV[1], ARGV[2], tonumber(ARGV[3]))
"""

# ARGV: base, task, version -> 1 when that version was current but its bytes are gone (now dropped)
DROP_BROKEN = _RETIRE + """
local base, task, ver = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', base .. ':cur', task) ~= ver then return 0 end
if redis.call('EXISTS', base .. ':blob:' .. task .. ':' .. ver) == 1 then return 0 end
return retire(base, task, 0)
"""

# ARGV: base -> {used, n, hits, misses, evictions}
STATS = """
local base = ARGV[1]
local s = redis.call('HMGET', base .. ':stats', 'hits', 'misses', 'evictions')
return {redis.call('GET', base .. ':used') or '0', redis.call('HLEN', base .. ':cur'),
        s[1] or '0', s[2] or '0', s[3] or '0'}
"""

# ARGV: base -> flat {task, version, last_used, record json, ...}, most recently used first
LIST = """
local base = ARGV[1]
local out = {}
for _, task in ipairs(redis.call('ZREVRANGE', base .. ':lru', 0, -1)) do
  local ver = redis.call('HGET', base .. ':cur', task)
  if ver then
    local meta = redis.call('GET', base .. ':meta:' .. task .. ':' .. ver)
    if meta then
      table.insert(out, task)
      table.insert(out, redis.call('HGET', base .. ':time', task) or '0')
      table.insert(out, meta)
    end
  end
end
return out
"""
