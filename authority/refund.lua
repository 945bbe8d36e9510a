-- leaselimit refund: return unused tokens to a token bucket, or charge it
-- for tokens used beyond what was taken (a negative n), into debt: an
-- adjustment of the ledger.
--
-- One call applies one adjustment, or several in turn: a refund queue's
-- flush makes one script call for the adjustments with ids of their own on
-- a node (a Settle's, charges), not one each; its refunds without go in
-- calls of refund_batch.lua, once per call. Adjustment j (from 1) has KEYS[3j-2..3j] and ARGV[7j-6..7j],
-- laid out as the first's:
--
-- KEYS[1]  the bucket (see common.lua)
-- KEYS[2]  the bucket's reset mark (see reset.lua)
-- KEYS[3]  the adjustment's id key: it exists once the adjustment was
--          applied (or dropped), for ARGV[7] ms.
--          A charge may come with KEYS[1] alone and ARGV[7] 0: the form for
--          a Redis Cluster slot in migration, where a script on a key that
--          does not exist yet (an id key never does) is refused, but one on
--          a single bucket is served by the node that holds it. It is
--          applied without the id (a resend charges again) and without the
--          mark (tokens taken before a Reset are charged to the fresh
--          bucket): both can only under-admit. That form comes alone.
-- ARGV     r, p (or a calendar quota's windows), burst (as in batch.lua's headers),
--          n (an integer: 1 <= n <= burst to refund, -2·burst <= n <= -1 to
--          charge), window, since, the id key's life in ms.
--          window: for a calendar quota, the end (µs) of the window the
--          tokens were taken in; 0 for a token bucket.
--          since: the server's clock (µs) no later than when the tokens
--          left the bucket (the grant's stamp: the now of batch.lua's reply); 0 if unknown.
-- Returns  for one adjustment, {remaining, reset_after_us}; remaining is
--          negative for a bucket in debt. For several, an array of their
--          replies in order, where one that failed (invalid arguments, a
--          command Redis refused) is {'e', its error} and the others are
--          applied all the same: each is applied once, by its own id,
--          whatever its neighbours did. A call's adjustments are applied
--          at one reading of the server's clock.
--
-- The ledger rule: tokens come back only to the generation and the window
-- they left, and once.
--   once: an adjustment is applied at most once, whatever runs in between:
--     go-redis resends a call whose connection broke, and leaselimit
--     resends an adjustment whose outcome it does not know, both under the
--     adjustment's own id (KEYS[3]), within that key's life.
--   generation: Reset (reset.lua) records when it emptied the bucket; an
--     adjustment of tokens that left before (since not after the mark) is
--     dropped: the fresh bucket never had them. A charge of unknown time
--     (since 0) is made: a doubt costs under-admission, never over. A
--     refund of tokens that left longer ago than a mark lives (see
--     common.lua's MARK_LIFE_US) is dropped: a Reset since may be gone.
--   window: a calendar quota's tokens of an earlier window (that window has
--     reset since) or of an unknown one are dropped: adding them to this
--     window's full bucket would create tokens, and charging this window
--     for the last one's use would take what it never gave.
-- A dropped adjustment only under-admits (a refund) or forgives (a charge,
-- whose window or generation has started afresh).
--
-- The bucket is refilled to now, then n tokens are added, capped at burst
-- and floored at -burst: a bucket owes at most one burst, which later
-- requests wait out. A missing key is full: a refund has nothing to do. A
-- bucket that becomes full is deleted, since a missing key reads as full.
local invalid = redis.error_reply('ERR leaselimit: invalid refund arguments')
local count = #ARGV / 7
local keyed = ARGV[7] ~= '0' -- with the mark and the id key
if count < 1 or count % 1 ~= 0 or #KEYS ~= count * (keyed and 3 or 1) or (not keyed and count > 1) then
  return invalid
end
local now, clock_err = now_us()
if clock_err then return clock_err end

-- report is the reply for an adjustment not applied: the bucket, w + f/p
-- tokens at last, as it is at now. Built once per call, not per
-- adjustment.
local function report(cal, w, f, last, a, b, burst)
  local reset = 0
  if w < burst then reset = wait(cal, burst - w, f, last, now, a, b) end
  return {w, reset}
end

-- adjust applies adjustment j (from 0) at now: its reply, or an error.
local function adjust(j)
  local o, k = 7 * j, 3 * j -- the ARGV and KEYS of those before it
  local cal, a, b, s = spec(o + 1)
  local burst = int(o + 3)
  local n, window, since, life = tonumber(ARGV[o + 4]), tonumber(ARGV[o + 5]), tonumber(ARGV[o + 6]), int(o + 7)
  if cal == nil or not (burst and n and window and since and (life or not keyed)) or n ~= n or n % 1 ~= 0 or n == 0
      or n > burst or n < -2 * burst or burst > HUGE or window ~= window or since ~= since
      or (ARGV[o + 7] ~= '0') ~= keyed or (not keyed and n > 0) then
    return invalid
  end

  local found, err, w0, f0, t0, rid, tail = load(KEYS[k + 1])
  if err then return err end
  if not found then
    w0, f0, t0, rid, tail = burst, 0, now, '-', ''
  end
  local w, f, last = advance(cal, w0, f0, t0, now, a, b, burst, s)

  if keyed then
    -- The mark is read before the id is recorded: an adjustment whose
    -- mark cannot be read fails and records nothing, so that a resend
    -- fails the same way rather than read as applied (a charge that
    -- never was would go uncounted).
    local mark
    mark, err = call('GET', KEYS[k + 2])
    if err then return err end
    if mark and not tonumber(mark) then
      -- Not ours (reset.lua writes a number): this adjustment fails,
      -- rather than the script, and its neighbours with it.
      return redis.error_reply('ERR leaselimit: reset mark ' .. KEYS[k + 2] .. ' holds an unknown value')
    end

    -- Once: SET NX both checks and records the id, so that nothing can
    -- run between the two.
    local fresh
    fresh, err = call('SET', KEYS[k + 3], '1', 'NX', 'PX', int_str(life))
    if err then return err end
    if not fresh then return report(cal, w, f, last, a, b, burst) end

    -- A charge of unknown time (since 0: the failure policy's admissions)
    -- goes to the bucket as it is: forgiven, it would over-admit.
    if mark and since <= tonumber(mark) and (n > 0 or since > 0) then return report(cal, w, f, last, a, b, burst) end
    -- Tokens older than a mark lives: a Reset since may be forgotten.
    if stale(n, since, now) then return report(cal, w, f, last, a, b, burst) end
  end
  if cal and window ~= last then return report(cal, w, f, last, a, b, burst) end
  if not found and n > 0 then return {burst, 0} end

  w = math.max(w + n, -burst)
  if w >= burst then
    local _
    _, err = call('DEL', KEYS[k + 1])
    if err then return err end
    return {burst, 0}
  end
  local reset = wait(cal, burst - w, f, last, now, a, b)
  -- The tail (the old form's last grant, see common.lua) is passed through.
  err = store(KEYS[k + 1], w, f, last, rid, tail, ttl_ms(reset))
  if err then return err end
  return {w, reset}
end

if count == 1 then return adjust(0) end
-- Several: a failed adjustment's error goes back as a value, {'e',
-- message}, not as an error element: go-redis reads an array's error
-- element of some codes (OOM, READONLY, LOADING, ...) as the whole reply's
-- error and leaves the rest of it unread, for the next reply to misread.
local replies = {}
for j = 1, count do
  local r = adjust(j - 1)
  if r.err then r = {'e', r.err} end
  replies[j] = r
end
return replies
