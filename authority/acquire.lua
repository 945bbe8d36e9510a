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
local now, err = now_us()
if err then return err end
local reply
reply, err = take(KEYS[1], 0, now)
if err then return err end
return reply
