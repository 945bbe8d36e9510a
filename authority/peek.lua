-- leaselimit peek: read a token bucket without changing it: GET and TIME,
-- no write.
--
-- KEYS[1]  the bucket (see common.lua). A missing key is a full bucket.
-- ARGV     r, p, burst (as for acquire.lua).
-- Returns  {tokens, retry_after_us, reset_after_us}: the whole tokens the
--          bucket holds now, the µs until it holds one (0 when it does),
--          and the µs until it is full.
local r, p, burst = int(1), int(2), int(3)
if not (r and p and burst) or burst > HUGE then
  return redis.error_reply('ERR leaselimit: invalid peek arguments')
end
local found, err, w, f, last = load(KEYS[1])
if err then return err end
if not found then return {burst, 0, 0} end
local now
now, err = now_us()
if err then return err end
w, f, last = refill(w, f, last, now, r, p, burst)
local retry, reset = 0, 0
if w < 1 then retry = until_tokens(1 - w, f, r, p) end
if w < burst then reset = until_tokens(burst - w, f, r, p) end
return {w, retry, reset}
