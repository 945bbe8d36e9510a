-- leaselimit common prelude, prepended to acquire.lua and refund.lua.
-- A bucket is a hash {s = tokens in units of 1/period_us of a token,
-- t = time of s in µs on this server's clock}; a missing key is full.
-- All arithmetic is on integers below 2^53, so it is exact in Lua's doubles.
local MAX = 9007199254740992

-- int returns ARGV[i] as an integer in [1, 2^53), or nil.
local function int(i)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= v or v % 1 ~= 0 or v < 1 or v >= MAX then return nil end
  return v
end

-- now_us reads the server's clock in microseconds.
local function now_us()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000000 + tonumber(clock[2])
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

