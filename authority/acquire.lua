-- leaselimit acquire: take between min and want tokens from a token bucket.
--
-- KEYS[1]  the bucket (see common.lua). A missing key is a full bucket.
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
if id ~= nil and (#id == 0 or #id > 64 or string.find(id, '%s')) then
  return redis.error_reply('ERR leaselimit: invalid acquire arguments')
end

local cap = burst * period
local now, err = now_us()
if err then return err end

local b
b, err = load(KEYS[1])
if err then return err end
if b and id ~= nil then
  local rid, g, r, t = string.match(b.tail, '^ (%S+) (%d+) (%d+) (%d+)$')
  if rid == id then return {tonumber(g), tonumber(r), 0, tonumber(t)} end
end
local s, last = cap, now
if b then s, last = b.s, b.t end
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
  local tail = ''
  if id ~= nil then
    tail = ' ' .. id .. ' ' .. int_str(granted) .. ' ' .. int_str(remaining) .. ' ' .. int_str(reset)
  end
  err = store(KEYS[1], s, last, tail, ttl_ms(reset))
  if err then return err end
end

local retry = 0
if granted == 0 then
  retry = math.ceil((min * period - s) / rate)
end
return {granted, remaining, retry, reset}
