-- leaselimit acquire_many: several acquire calls in one script invocation,
-- for keys on one node (a single server, or one Cluster slot).
--
-- KEYS     the buckets, one per call (a key may appear more than once).
-- ARGV     7 arguments per call, in KEYS order: r, p, burst, want, min,
--          share_ppm and the request id, as for acquire.lua.
-- Returns  one element per call: the reply acquire.lua would give, or the
--          error reply it would give (our arguments' errors, or a command
--          Redis refused), so one call's error never fails the others.
--          The calls are decided in order, on one reading of the clock.
if #ARGV ~= 7 * #KEYS then
  return redis.error_reply('ERR leaselimit: invalid acquire arguments')
end
local now, err = now_us()
if err then return err end
local out = {}
for i = 1, #KEYS do
  local reply, e = take(KEYS[i], 7 * (i - 1), now)
  out[i] = reply or e
end
return out
