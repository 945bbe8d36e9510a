-- leaselimit refund: return unused tokens to a token bucket, or charge it
-- for tokens used beyond what was taken (a negative n), into debt.
--
-- KEYS[1]  the bucket (see common.lua)
-- ARGV     r, p (or a calendar quota's windows), burst (see acquire.lua), n (an integer: 1 <= n <= burst
--          to refund, -2·burst <= n <= -1 to charge), and optionally a
--          request id: an adjustment whose id equals that of the bucket's
--          last one is not applied again (go-redis resends a pipeline whose
--          connection broke), and returns the bucket as it is; for a
--          calendar quota, ARGV[6]: the end (µs) of the window the refunded
--          tokens were taken in (see below).
-- Returns  {remaining, reset_after_us}; remaining is negative for a bucket
--          in debt.
--
-- The bucket is refilled to now, then n tokens are added, capped at burst
-- and floored at -burst: a bucket owes at most one burst, which later
-- requests wait out. A missing key is full: a refund has nothing to do. A
-- bucket that becomes full is deleted, since a missing key reads as full.
local cal, a, b = spec(1)
local burst = int(3)
local n = tonumber(ARGV[4])
if cal == nil or not (burst and n) or n ~= n or n % 1 ~= 0 or n == 0 or n > burst or n < -2 * burst or burst > HUGE then
  return redis.error_reply('ERR leaselimit: invalid refund arguments')
end
local id = ARGV[5]
if id ~= nil and (not valid_id(id) or id == '-') then
  return redis.error_reply('ERR leaselimit: invalid refund arguments')
end

local found, err, w0, f0, t0, rid, tail = load(KEYS[1])
if err then return err end
if not found and n > 0 then
  return {burst, 0}
end
local now
now, err = now_us()
if err then return err end
if not found then
  w0, f0, t0, rid, tail = burst, 0, now, '-', ''
end
local w, f, last = advance(cal, w0, f0, t0, now, a, b, burst)
-- A calendar quota's refund gives back tokens of one window: ARGV[6], the
-- end of the window they were taken in. Tokens of an earlier window (that
-- window has reset since) or of an unknown one are not given back: adding
-- them to this window's full bucket would create tokens.
if cal and n > 0 and tonumber(ARGV[6]) ~= last then
  local reset = 0
  if w < burst then reset = wait(cal, burst - w, f, last, now, a, b) end
  return {w, reset}
end
if id ~= nil and rid == id then
  -- Applied already: report the bucket, change nothing.
  local reset = 0
  if w < burst then reset = wait(cal, burst - w, f, last, now, a, b) end
  return {w, reset}
end

w = math.max(w + n, -burst)
if w >= burst then
  local _
  _, err = call('DEL', KEYS[1])
  if err then return err end
  return {burst, 0}
end
local reset = wait(cal, burst - w, f, last, now, a, b)
-- The tail (the last grant's request id and reply) is kept: a resent
-- acquire must still find it.
err = store(KEYS[1], w, f, last, id or rid, tail, ttl_ms(reset))
if err then return err end
return {w, reset}
