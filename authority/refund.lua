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
local state = redis.call('HMGET', KEYS[1], 's', 't')
local s, last = tonumber(state[1]), tonumber(state[2])
if s == nil or last == nil then
  return {burst, 0}
end

s, last = refill(s, last, now_us(), rate, cap)

s = s + n * period
if s >= cap then
  redis.call('DEL', KEYS[1])
  return {burst, 0}
end
local reset = math.ceil((cap - s) / rate)
redis.call('HSET', KEYS[1], 's', s, 't', last)
redis.call('PEXPIRE', KEYS[1], math.ceil(reset / 1000) + 1000)
return {math.floor(s / period), reset}
