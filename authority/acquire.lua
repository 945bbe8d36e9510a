-- leaselimit acquire: take between min and want tokens from a token bucket.
--
-- KEYS[1]  the bucket: a hash {s = tokens in units of 1/period_us of a token,
--          t = time of s in µs on this server's clock}. A missing key is a full bucket.
-- ARGV     rate, period_us, burst, want, min, share_ppm (all integers), and
--          optionally a request id: a call whose id equals that of the bucket's
--          last grant returns that grant again and takes nothing, so a client
--          that resends the call (go-redis retries on a lost connection) does
--          not take the tokens twice.
--          rate tokens are added per period_us µs, up to burst tokens.
--          Grant g tokens with min <= g <= want and g <= max(min, floor(available*share_ppm/1e6)),
--          or nothing when fewer than min tokens are available. A denial writes nothing.
-- Returns  {granted, remaining, retry_after_us, reset_after_us}
--          retry_after_us: 0 when granted, else µs until min tokens are available.
--          reset_after_us: µs until the bucket is full again.
--
-- A token is period_us units, and one µs of refill adds rate units (see common.lua).
local rate, period, burst, want, min, share = int(1), int(2), int(3), int(4), int(5), int(6)
if not (rate and period and burst and want and min and share)
    or share > 1000000 or min > want or want > burst or burst > (MAX - rate) / period then
  return redis.error_reply('ERR leaselimit: invalid acquire arguments')
end

local id = ARGV[7]
if id ~= nil and (#id == 0 or #id > 64) then
  return redis.error_reply('ERR leaselimit: invalid acquire arguments')
end

local cap = burst * period
local now = now_us()

local state = redis.call('HMGET', KEYS[1], 's', 't', 'r', 'p')
if id ~= nil and state[3] == id and state[4] then
  local p = {}
  for v in string.gmatch(state[4], '%d+') do p[#p + 1] = tonumber(v) end
  if #p == 4 then return p end
end
local s, last = tonumber(state[1]), tonumber(state[2])
if s == nil or last == nil then
  s, last = cap, now
end
s, last = refill(s, last, now, rate, cap)

local granted = 0
local avail = math.floor(s / period)
if avail >= min then
  -- floor(avail * share / 1e6), exactly: split avail so no product passes 2^53.
  granted = math.floor(avail / 1000000) * share + math.floor((avail % 1000000) * share / 1000000)
  if granted < min then granted = min end
  if granted > want then granted = want end
  s = s - granted * period
end

local reset = math.ceil((cap - s) / rate)
local remaining = math.floor(s / period)
if granted > 0 then
  if id ~= nil then
    redis.call('HSET', KEYS[1], 's', s, 't', last, 'r', id,
      'p', string.format('%.0f %.0f 0 %.0f', granted, remaining, reset))
  else
    redis.call('HSET', KEYS[1], 's', s, 't', last)
  end
  -- The key lives until the bucket would be full again (a missing key reads
  -- as full), plus a margin.
  redis.call('PEXPIRE', KEYS[1], math.ceil(reset / 1000) + 1000)
end

local retry = 0
if granted == 0 then
  retry = math.ceil((min * period - s) / rate)
end
return {granted, remaining, retry, reset}
