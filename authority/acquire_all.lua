-- leaselimit acquire_all: take the same tokens from several token buckets
-- at once, or from none: a request under several limits ("20/s and
-- 10,000/day") that one of them denies takes nothing from the others.
--
-- KEYS     the resend key, "<prefix>:batch:{<hash tag>}:<id>" (see batch.lua's
--          batch key: it holds the reply of a call that granted, so that
--          one go-redis resends returns it and takes nothing; read and
--          claimed once the call is decided, see the end), then the
--          buckets (see common.lua); on a Cluster they all share a hash slot
--          (their hash tag is the digest of one user key). With window_ms 0
--          there is no resend key (the form for a Cluster slot in
--          migration, see batch.lua): KEYS are the buckets.
-- ARGV     window_ms (how long the resend key keeps the reply), want, min,
--          share_ppm (as for a call of batch.lua), then r, p (or a calendar
--          quota's windows, see spec), burst for each bucket, in KEYS order.
-- Returns  {granted, denied, retry_after_us, then remaining_i, reset_after_us_i
--          for each key, then now}: now (µs, the server's clock) stamps the
--          grant for the ledger (see refund.lua); denied is 0 when granted, else the (1-based) index
--          of the bucket that makes the request wait longest; retry_after_us
--          is how long until every bucket holds min tokens. A grant takes the
--          same g tokens from every bucket, min <= g <= want, and no more than
--          max(min, floor(tokens * share)) of any one. A denial writes nothing
--          (but for a resend's reply, kept: see always).
--          A bucket's tail (see common.lua) is passed through as it is.
local BAD = 'ERR leaselimit: invalid acquire_all arguments'
local keyed = ARGV[1] ~= '0' -- KEYS[1] is the resend key
-- replied is the reply a resend key holds, as the first sending returned it.
local function replied(done)
  local out = {}
  for v in string.gmatch(done, '%d+') do out[#out + 1] = tonumber(v) end
  return out
end
-- A window_ms given negative is a resend that learns a cut call's outcome:
-- its reply is kept even for a denial (see batch.lua's always).
local always = keyed and ARGV[1] ~= nil and ARGV[1] < '0'
if always then ARGV[1] = string.sub(ARGV[1], 2) end
local window, want, min, share = int(1), int(2), int(3), int(4)
local o = keyed and 1 or 0 -- KEYS[o + i] is bucket i
local n = #KEYS - o
if not ((window or not keyed) and want and min and share) or share > 1000000 or min > want
    or #ARGV ~= 4 + 3 * n or n < 1 then
  return redis.error_reply(BAD)
end
local now, err = now_us()
if err then return err end
local b = {}
local g, denied, retry = want, 0, 0
for i = 1, n do
  local base = 4 + 3 * (i - 1)
  local cal, a, bb, s = spec(base + 1)
  local burst = int(base + 3)
  if cal == nil or not burst or want > burst or burst > HUGE then
    return redis.error_reply(BAD)
  end
  local found, e, w, f, last, rid, tail = load(KEYS[o + i])
  if e then
    -- A bucket that cannot be read (another program's value or type)
    -- fails the call, unless it is a resend of one that was decided:
    -- then the first sending's reply (see the end), its tokens taken.
    local done = keyed and redis.pcall('GET', KEYS[1])
    if type(done) == 'string' then return replied(done) end
    return e
  end
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
for i = 1, n do
  local x = b[i]
  x.w = x.w - g
  x.reset = 0
  if x.w < x.burst then x.reset = wait(x.cal, x.burst - x.w, x.f, x.last, now, x.a, x.b) end
  out[3 + 2 * i - 1] = math.max(x.w, 0)
  out[3 + 2 * i] = x.reset
end
out[4 + 2 * n] = now
-- The resend key, read and claimed in one command once the call is
-- decided and before any bucket is written (as batch.lua's lone call):
-- the reply stored unless one is there already (SET NX GET), which is
-- then the first sending's, returned instead, nothing taken; for a call
-- that took nothing (unless always), only the read. Redis refuses a
-- script's writes only until its first has passed, so the buckets' writes
-- after a claim that passed are not refused.
if keyed then
  local done
  if g > 0 or always then
    local text = {}
    for i, v in ipairs(out) do text[i] = int_str(v) end
    done, err = call('SET', KEYS[1], table.concat(text, ' '), 'NX', 'GET', 'PX', int_str(window))
  else
    done, err = call('GET', KEYS[1])
  end
  if err then return err end
  if done then return replied(done) end -- a resend: nothing taken
end
if g > 0 then
  for i = 1, n do
    local x = b[i]
    err = store(KEYS[o + i], x.w, x.f, x.last, x.rid, x.tail, ttl_ms(x.reset))
    if err then
      -- The claim deleted again, so that no resend returns a grant not
      -- written: an ACL selector may allow SET on resend keys and not on
      -- buckets (maxmemory, a read-only replica or a failed save refuse a
      -- script's writes only until its first has passed). A bucket written
      -- before the refusal keeps its debit: fewer tokens, never more.
      if keyed then redis.pcall('DEL', KEYS[1]) end
      return err
    end
  end
end
return out
