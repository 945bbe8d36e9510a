-- leaselimit peek: read a token bucket without changing it: GET and TIME,
-- no write.
--
-- KEYS[1]  the bucket (see common.lua). A missing key is a full bucket.
-- ARGV     r, p (or a calendar quota's windows), burst (as in batch.lua's headers).
-- Returns  {tokens, retry_after_us, reset_after_us}: the whole tokens the
--          bucket holds now, the µs until it holds one (0 when it does),
--          and the µs until it is full.
local cal, a, b, s = spec(1)
local burst = int(3)
if cal == nil or not burst or burst > HUGE then
  return redis.error_reply('ERR leaselimit: invalid peek arguments')
end
local found, err, w, f, last = load(KEYS[1])
if err then return err end
if not found then return {burst, 0, 0} end
local now
now, err = now_us()
if err then return err end
w, f, last = advance(cal, w, f, last, now, a, b, burst, s)
local retry, reset = 0, 0
if w < 1 then retry = wait(cal, 1 - w, f, last, now, a, b) end
if w < burst then reset = wait(cal, burst - w, f, last, now, a, b) end
return {w, retry, reset}
