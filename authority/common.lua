-- leaselimit common prelude, prepended to acquire.lua and refund.lua.
--
-- A bucket is one string, "<s> <t>" or "<s> <t> <id> <granted> <remaining> <reset>":
-- s tokens in units of 1/period_us of a token, t the time of s in µs on this
-- server's clock, then the request id of the bucket's last grant and that
-- grant's reply. It is written by one SET ... PX, so the state never exists
-- without its TTL, and a refused write leaves nothing behind. A missing key is
-- a full bucket. All arithmetic is on integers below 2^53, so it is exact in
-- Lua's doubles.
local MAX = 9007199254740992

-- int returns ARGV[i] as an integer in [1, 2^53), or nil.
local function int(i)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= v or v % 1 ~= 0 or v < 1 or v >= MAX then return nil end
  return v
end

-- call runs a Redis command; a refusal (an ACL without it, OOM, a read-only
-- replica) comes back as an error reply that names the command, with
-- Redis's own error code first so that callers classify it as Redis meant.
local function call(cmd, ...)
  local r = redis.pcall(cmd, ...)
  if type(r) == 'table' and r.err then
    return nil, redis.error_reply(r.err .. ' (leaselimit: Redis refused ' .. cmd .. ' in the script)')
  end
  return r
end

-- now_us reads the server's clock in microseconds.
local function now_us()
  local clock, err = call('TIME')
  if err then return nil, err end
  return tonumber(clock[1]) * 1000000 + tonumber(clock[2])
end

-- int_str formats an integer below 2^53 without an exponent.
local function int_str(v)
  return string.format('%.0f', v)
end

-- load reads the bucket at key: nil for a missing (full) bucket, else
-- {s, t, tail}, tail being the request-id part (" <id> <granted> <remaining> <reset>" or "").
local function load(key)
  local v, err = call('GET', key)
  if err then return nil, err end
  if not v then return nil end
  local s, t, tail = string.match(v, '^(%d+) (%d+)(.*)$')
  if not s then
    return nil, redis.error_reply('ERR leaselimit: bucket ' .. key .. ' holds an unknown value')
  end
  return {s = tonumber(s), t = tonumber(t), tail = tail}
end

-- store writes the bucket at key with a TTL of ttl_ms, in one command.
local function store(key, s, t, tail, ttl_ms)
  local _, err = call('SET', key, int_str(s) .. ' ' .. int_str(t) .. tail, 'PX', int_str(ttl_ms))
  return err
end

-- refill brings s (valid at last) to now, capped at cap; rate units are
-- added per µs. A clock that went backwards (failover to a server with
-- another clock) refills nothing and keeps the later timestamp.
local function refill(s, last, now, rate, cap)
  if s > cap then s = cap end   -- the burst was lowered since the last write
  if s < 0 then s = 0 end
  if now > last then
    if (now - last) * rate >= cap - s then
      s = cap
    else
      s = s + (now - last) * rate
    end
    last = now
  end
  return s, last
end

-- ttl_ms is how long a bucket lives: until it would be full again (a
-- missing key reads as full), reset µs from now, plus a margin.
local function ttl_ms(reset)
  return math.ceil(reset / 1000) + 1000
end

