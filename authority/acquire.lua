-- leaselimit acquire: take between min and want tokens from a token bucket.
--
-- KEYS[1]  the bucket (see common.lua). A missing key is a full bucket.
-- ARGV     r, p, burst, want, min, share_ppm (all integers), and optionally a
--          request id: a call whose id equals that of the bucket's last grant
--          returns that grant again and takes nothing, so a client that
--          resends the call (go-redis retries on a lost connection) does not
--          take the tokens twice.
--          r tokens are added every p µs (the limit's rate and period reduced
--          by their gcd), up to burst tokens.
--          Grant g tokens with min <= g <= want and g <= max(min, floor(available*share_ppm/1e6)),
--          or nothing when fewer than min tokens are available. A denial writes nothing.
-- Returns  {granted, remaining, retry_after_us, reset_after_us}
--          retry_after_us: 0 when granted, else µs until min tokens are available.
--          reset_after_us: µs until the bucket is full again.
--          Both saturate at 2^52 µs (about 142 years).
local r, p, burst, want, min, share = int(1), int(2), int(3), int(4), int(5), int(6)
if not (r and p and burst and want and min and share)
    or share > 1000000 or min > want or want > burst or burst > HUGE then
  return redis.error_reply('ERR leaselimit: invalid acquire arguments')
end

local id = ARGV[7]
if id ~= nil and not valid_id(id) then
  return redis.error_reply('ERR leaselimit: invalid acquire arguments')
end

local now, err = now_us()
if err then return err end

local b
b, err = load(KEYS[1])
if err then return err end
if b and id ~= nil then
  local rid, g, rem, t = string.match(b.tail, '^ (%S+) (%d+) (%d+) (%d+)$')
  if rid == id then return {tonumber(g), tonumber(rem), 0, tonumber(t)} end
end
local w, f, last = burst, 0, now
if b then w, f, last = b.w, b.f, b.t end
w, f, last = refill(w, f, last, now, r, p, burst)

local granted = 0
if w >= min then
  -- floor(w * share / 1e6), exactly: split w so no product passes 2^53.
  granted = math.floor(w / 1000000) * share + math.floor((w % 1000000) * share / 1000000)
  if granted < min then granted = min end
  if granted > want then granted = want end
  w = w - granted
end

local reset = 0
if w < burst then reset = until_tokens(burst - w, f, r, p) end
if granted > 0 then
  local tail = ''
  if id ~= nil then
    tail = ' ' .. id .. ' ' .. int_str(granted) .. ' ' .. int_str(w) .. ' ' .. int_str(reset)
  end
  local rid = '-'
  if b then rid = b.rid end
  err = store(KEYS[1], w, f, last, rid, tail, ttl_ms(reset))
  if err then return err end
end

local retry = 0
if granted == 0 then
  retry = until_tokens(min - w, f, r, p)
end
return {granted, w, retry, reset}
