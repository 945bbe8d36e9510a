-- leaselimit acquire_all: take the same tokens from several token buckets
-- at once, or from none: a request under several limits ("20/s and
-- 10,000/day") that one of them denies takes nothing from the others.
--
-- KEYS     the buckets (see common.lua); on a Cluster they share a hash
--          slot (their hash tag is the digest of one user key).
-- ARGV     want, min, share_ppm (as for a call of batch.lua), then r, p (or a
--          calendar quota's windows, see spec), burst for each key, in KEYS
--          order.
-- Returns  {granted, denied, retry_after_us, then remaining_i, reset_after_us_i
--          for each key, then now}: now (µs, the server's clock) stamps the
--          grant for the ledger (see refund.lua); denied is 0 when granted, else the (1-based) index
--          of the bucket that makes the request wait longest; retry_after_us
--          is how long until every bucket holds min tokens. A grant takes the
--          same g tokens from every bucket, min <= g <= want, and no more than
--          max(min, floor(tokens * share)) of any one. A denial writes nothing.
--          A bucket's tail (see common.lua) is passed through as it is.
local want, min, share = int(1), int(2), int(3)
if not (want and min and share) or share > 1000000 or min > want or #ARGV ~= 3 + 3 * #KEYS or #KEYS < 1 then
  return redis.error_reply('ERR leaselimit: invalid acquire_all arguments')
end
local now, err = now_us()
if err then return err end
local b = {}
local g, denied, retry = want, 0, 0
for i = 1, #KEYS do
  local base = 3 + 3 * (i - 1)
  local cal, a, bb, s = spec(base + 1)
  local burst = int(base + 3)
  if cal == nil or not burst or want > burst or burst > HUGE then
    return redis.error_reply('ERR leaselimit: invalid acquire_all arguments')
  end
  local found, e, w, f, last, rid, tail = load(KEYS[i])
  if e then return e end
  if not found then w, f, last, rid, tail = burst, 0, now, '-', '' end
  w, f, last = advance(cal, w, f, last, now, a, bb, burst, s)
  b[i] = {w = w, f = f, last = last, rid = rid, tail = tail, cal = cal, a = a, b = bb, burst = burst}
  if w < min then
    local due = wait(cal, min - w, f, last, now, a, bb)
    if due > retry or denied == 0 then denied, retry = i, math.max(retry, due) end
  else
    local cap = math.floor(w / 1000000) * share + math.floor((w % 1000000) * share / 1000000)
    g = math.min(g, math.max(cap, min))
  end
end
if denied > 0 then g = 0 end
local out = {g, denied, retry}
for i = 1, #KEYS do
  local x = b[i]
  local w = x.w - g
  local reset = 0
  if w < x.burst then reset = wait(x.cal, x.burst - w, x.f, x.last, now, x.a, x.b) end
  if g > 0 then
    err = store(KEYS[i], w, x.f, x.last, x.rid, x.tail, ttl_ms(reset))
    if err then return err end
  end
  out[3 + 2 * i - 1] = math.max(w, 0)
  out[3 + 2 * i] = reset
end
out[4 + 2 * #KEYS] = now
return out
