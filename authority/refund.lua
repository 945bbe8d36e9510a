-- leaselimit refund: return unused leased tokens to a token bucket.
--
-- KEYS[1]  the bucket (see acquire.lua)
-- ARGV     rate, period_us, burst, n (all integers; 1 <= n <= burst)
-- Returns  {remaining, reset_after_us}
--
-- The bucket is refilled to now, then n tokens are added, capped at burst.
-- A missing key is already full: nothing to do. A bucket that becomes full is
-- deleted, since a missing key reads as full.
local rate, period, burst, n = int(1), int(2), int(3), int(4)
if not (rate and period and burst and n) or n > burst or burst > (MAX - rate) / period then
  return redis.error_reply('ERR leaselimit: invalid refund arguments')
end

local cap = burst * period
local b, err = load(KEYS[1])
if err then return err end
if not b then
  return {burst, 0}
end
local now
now, err = now_us()
if err then return err end
local s, last = refill(b.s, b.t, now, rate, cap)

s = s + n * period
if s >= cap then
  local _
  _, err = call('DEL', KEYS[1])
  if err then return err end
  return {burst, 0}
end
local reset = math.ceil((cap - s) / rate)
-- The tail (the last grant's request id and reply) is kept: a resent
-- acquire must still find it.
err = store(KEYS[1], s, last, b.tail, ttl_ms(reset))
if err then return err end
return {math.floor(s / period), reset}
