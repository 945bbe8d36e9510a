-- leaselimit batch: decide a batch of single-limit acquire calls in one
-- invocation, on one reading of the clock, in the order given. It stands
-- alone but for muldiv.lua (common.lua is not prepended): it needs only a
-- few of its helpers, and a script's local functions are made anew on every
-- invocation.
--
-- KEYS[1]    the batch key, "<prefix>:batch:{<hash tag>}:<batch id>": it
--            holds this invocation's reply once a call was granted, for
--            ARGV[1] ms (a resend's reply even if it granted nothing: see
--            always). An invocation that finds it returns that reply and
--            takes nothing: go-redis resends a pipeline whose connection
--            broke, and the resent invocation must not take tokens twice.
--            A batch reads it first; a lone call reads and writes it in
--            one command once decided, before its bucket's write (see
--            lone, claim).
--            With window_ms 0 there is no batch key, and KEYS[i] is the
--            bucket of call i: the form for a Redis Cluster slot in
--            migration, where a script on a key that does not exist yet
--            (a batch key never does) is refused (TRYAGAIN), but one on a
--            single bucket is served by the node that holds it. A resent
--            invocation of that form takes again (under-admission only).
-- KEYS[1+i]  the bucket of call i (see common.lua). A key may appear more
--            than once. Calls on one key that come one after another (the
--            client puts them together) are decided in order on one reading
--            of it, and it is written once, when another key comes or the
--            batch ends, with the state after its last grant (a key without
--            a grant is not written); a key that comes back after another is
--            read again, and finds that write.
-- ARGV       window_ms, L, then L limit headers of three values each
--            (L = -1: one token bucket; see below):
--              r, p, burst       a token bucket: r tokens every p µs (the
--                                rate and period reduced by their gcd)
--              'w<end>:<start>', next, burst
--                                a calendar quota: the end and start (µs,
--                                the client's clock) of its window and the
--                                end of the next one, as spec in
--                                common.lua reads them
--            then, per call, in KEYS order:
--              k, want           an exact call (min = want, share 1) under
--                                limit k (1 <= k <= L)
--              L+k, want, min, share_ppm
--                                any other call under limit k: grant g with
--                                min <= g <= want and
--                                g <= max(min, floor(available*share_ppm/1e6))
--            or, when L is -1 (one token bucket: the usual batch, decided
--            on a path of its own), per call
--              want              an exact call: its cost alone
--              -want, min, share_ppm
--                                any other call, as above.
--            Every number is an integer.
-- Returns    one bulk string: "<s> <us>", the server's clock as TIME gave
--            it (now = s*10^6 + us µs; the strings themselves, as
--            formatting now cost an invocation of one call about 1 µs, a
--            twelfth of the lean contract's whole script, in Redis), then per call " <granted> <w> <x>":
--            granted 0 for a denial; w the whole tokens left (negative for a
--            bucket in debt); x the fraction f of a token bucket (it holds
--            w + f/p tokens at now), or the window's end of a calendar quota.
--            When L is -1, an exact call has two values, " <w> <x>",
--            granted being want or nothing: x for a grant, -1 - x for a
--            denial; any other call the usual three.
--            The caller derives retry_after (until min tokens, denials only)
--            and reset_after (until burst tokens) from them, as take() in
--            the acquire script it replaced did: ceil((m*p - f)/r) µs for m tokens,
--            saturated at 2^52, or window end - now for a quota. A call whose
--            bucket could not be read (another program's key, a refused GET)
--            reads " e <j> 0" (" e <j>" for an exact call when L is -1): the j-th line after
--            the first holds the error.
--
-- The bucket is written in the compact form "<w> <f> <t> -"; the old form
-- "<w> <f> <t> <rid> <id> <granted> <remaining> <reset>" is read too (its
-- tail is ignored). Every number is an integer below 2^53, exact in Lua's
-- doubles; products that could pass 2^53 go through muldiv.
local BAD = 'ERR leaselimit: invalid batch arguments'

-- refused is the error reply for a command Redis refused (an ACL without
-- it, OOM, a read-only replica, another program's key): Redis's own error
-- code first, so that callers classify it as Redis meant.
local function refused(cmd, r)
  return r.err .. ' (leaselimit: Redis refused ' .. cmd .. ' in the script)'
end

-- portion is the grant of a call with a min below its want from a bucket
-- holding w >= min whole tokens: floor(w * share_ppm / 1e6), exactly (w
-- split so that no product passes 2^53), within [min, want].
local function portion(w, want, min, share)
  local floor = math.floor -- not the script's: a function that captures none is made at little cost
  local g = floor(w / 1000000) * share + floor((w % 1000000) * share / 1000000)
  if g < min then return min end
  if g > want then return want end
  return g
end

-- claim is a lone call's resend check (see lone), once the call is
-- decided and before its bucket's write (a missing bucket that a call of
-- cost 1 wrote as it read it, fresh, is deleted again should the claim
-- find a reply or be refused): its reply stored under the batch key
-- unless one is there already (SET NX GET), which is then the first
-- sending's, for the caller to return instead; for a call that keeps no
-- reply (it took nothing, and it is not always), only the read. It
-- returns that reply (false: none), or Redis's refusal, and the command
-- asked. A bucket's write refused after a claim that passed deletes the
-- batch key again, so that no resend returns a grant that was not
-- written: Redis refuses a script's writes for maxmemory, a read-only
-- replica or a failed save only until its first has passed, but an ACL
-- selector may allow SET on batch keys and not on buckets.
local function claim(batch_key, reply, keep, window)
  if keep then
    return redis.pcall('SET', batch_key, reply, 'NX', 'GET', 'PX', window), 'SET'
  end
  return redis.pcall('GET', batch_key), 'GET'
end

-- Locals: every reading of a global is a table lookup, two per call here
-- (about 2.6% of an invocation of 18 calls on one key, in the machine
-- instructions of plain Lua 5.1).
local KEYS, ARGV = KEYS, ARGV
local keyed = ARGV[1] ~= '0' -- KEYS[1] is the batch key
-- A window_ms given negative is a resend that learns the outcome of a call
-- whose reply a deadline cut (see Redis.Resend): its reply is kept even
-- when nothing was granted, so that the first sending, should it run
-- later, returns that denial and takes nothing. ('-' sorts before '0'.)
local always = keyed and ARGV[1] ~= nil and ARGV[1] < '0'
if always then ARGV[1] = string.sub(ARGV[1], 2) end
local base = keyed and 1 or 0 -- KEYS[base + i] is call i's bucket
local n = #KEYS - base
local type = type

-- lone: a batch of one call (the long tail's usual invocation, and a lone
-- caller's) has its batch key read and claimed in one command once the
-- call is decided, before its bucket's write (see claim), where any
-- other batch reads it here and writes it at the end: a GET less, 1.2 to
-- 1.8 µs of Redis's time per such invocation (medians of alternated
-- rounds, present and missing buckets). A batch of several calls writes
-- buckets as it goes, so it must know it is not a resend before its
-- first write.
local lone = keyed and n == 1
if keyed and not lone then
  local done = redis.pcall('GET', KEYS[1])
  if type(done) == 'table' then return redis.error_reply(refused('GET', done)) end
  if done then return done end
end

if ARGV[2] == '-1' then
  -- The usual batch: one token bucket (a lease's refills among its
  -- exact calls, or not). It is decided here, on a path of its own that
  -- builds none of the general path's tables of limits and functions,
  -- calls no function but portion (for a refill), and makes the
  -- arithmetic's (see arith in muldiv.lua) only for a product past 2^53:
  -- its refill and TTL are muldiv's fast path, inline (keep them alike).
  -- In Lua 5.1 a call costs about as much as the work these do, and
  -- making a function that captures the script's locals costs
  -- allocations. With int, read, write, refill and until_tokens called,
  -- an invocation of one call ran 1.5 times the VM instructions it runs
  -- now and took about 2 µs more of Redis's time; with muldiv made and
  -- called, 5% more machine instructions (callgrind, plain Lua) and about
  -- 0.8 µs more. The bucket in hand is the general path's (see there), on
  -- one limit.
  local window, r, p, burst = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  -- int's tests inline: integers in [1, MAX) (a NaN fails every
  -- comparison), burst at most HUGE; window only when there is a batch key.
  if not (r and p and burst and r >= 1 and p >= 1 and burst >= 1 and r < MAX and p < MAX and burst <= HUGE
      and r % 1 == 0 and p % 1 == 0 and burst % 1 == 0) or n < 1
      or keyed and not (window and window >= 1 and window < MAX and window % 1 == 0) then
    return redis.error_reply(BAD)
  end
  -- Every call's arguments are checked before any bucket is read or
  -- written, so that a bad list leaves nothing behind. A negative want
  -- starts a call with a min and a share. The wants are kept as read: a
  -- tonumber costs more than a call's whole argument check, and a table
  -- of them far less.
  local j = 6 -- the next call's first ARGV
  local wants = {}
  for c = 1, n do
    -- A cost of 1, nearly every call's, by one comparison: Lua's strings
    -- are interned, so it compares two pointers where tonumber runs
    -- strtod, about an eighth of a call's whole work in the script.
    local a = ARGV[j]
    local want = a == '1' and 1 or tonumber(a or '')
    wants[c] = want
    if want and want < 0 then
      local min, share = tonumber(ARGV[j + 1] or ''), tonumber(ARGV[j + 2] or '')
      want = -want
      if not (min and share and min >= 1 and min <= want and min % 1 == 0
          and share >= 1 and share <= 1000000 and share % 1 == 0) then
        return redis.error_reply(BAD)
      end
      j = j + 3
    else
      j = j + 1
    end
    if not (want and want >= 1 and want <= burst and want % 1 == 0) then return redis.error_reply(BAD) end
  end
  if #ARGV ~= j - 1 then return redis.error_reply(BAD) end
  local clock = redis.pcall('TIME')
  if clock.err then return redis.error_reply(refused('TIME', clock)) end
  local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  local format, match, pcall = string.format, string.match, redis.pcall
  local out, errs, any, reply = {clock[1], ' ', clock[2]}, nil, false, nil
  -- The bucket in hand, as the general path's: w + f/p tokens at t,
  -- refilled to now when read, written when the next key comes if took.
  local key, w, f, t, took, ej = nil, 0, 0, 0, false, nil
  -- fresh: the key in hand was missing and is written with its one call
  -- granted (see read below): freshv, freshpx, freshout its value, TTL
  -- and reply, made at the first such key; missing counts the keys found
  -- missing less those found present so far.
  local fresh, freshv, freshpx, freshout, missing = false, nil, nil, nil, 0
  j = 6
  for c = 1, n + 1 do
    local kc = KEYS[base + c] -- nil after the last call: write its bucket
    if kc ~= key then
      if kc == nil then -- every call decided
        reply = table.concat(out)
        if errs then reply = reply .. '\n' .. table.concat(errs, '\n') end
      end
      if kc == nil and lone then
        -- A resend or a refused claim (see claim): a key this run found
        -- missing and wrote (fresh) is deleted again, missing as it was.
        local done, cmd = claim(KEYS[1], reply, any or always, window)
        if done then
          if fresh then pcall('DEL', key) end
          if type(done) == 'table' then return redis.error_reply(refused(cmd, done)) end
          return done
        end
      end
      if took then
        -- write: w < burst after a grant; the TTL lasts until the
        -- bucket is full again (until_tokens(burst - w, f, r, p) µs),
        -- plus a margin.
        local x, q = (burst - w - 1) * p + (p - f), nil
        if x < MAX then
          q = floor(x / r) -- then corrected for the division's rounding, to the ceiling
          if q * r > x then q = q - 1 end
          if q * r < x then q = q + 1 end
          if q > HUGE then q = HUGE end
        else
          local _, until_tokens = arith(MAX, HUGE, floor)
          q = until_tokens(burst - w, f, r, p)
        end
        local res = pcall('SET', key, format('%d %d %d -', w, f, t), 'PX', math.ceil(q / 1000) + 1000)
        if res.err then
          if lone then pcall('DEL', KEYS[1]) end -- its claim (see claim)
          return redis.error_reply(refused('SET', res))
        end
      end
      if kc == nil then break end
      key, took, ej, fresh = kc, false, nil, false
      -- read: a missing key is a full bucket. A lone call of cost 1 on
      -- its key (the long tail's usual call) asks in one command: SET NX
      -- GET writes what the call leaves of a full bucket if the key is
      -- missing (its reply then nil), else changes nothing and returns
      -- the bucket, decided as usual. On the long tail the key has
      -- expired, and GET then SET cost about a fifth more of Redis's time
      -- than the one SET; on a present key the SET NX GET costs a sixth
      -- to a half more than a GET (both measured in a loop of 200k keys
      -- in one script on redis-server 7.0.15). So it is asked while the
      -- batch has found at least as many keys missing as present. Its
      -- value and TTL are the same for every such key of the batch, made
      -- once; a refused SET NX GET reads again with GET, so that every
      -- refusal is met as before (but for an ACL that allows SET and not
      -- GET: a lone call of the form without a batch key now passes,
      -- debited as any).
      local v
      if missing >= 0 and wants[c] == 1 and KEYS[base + c + 1] ~= kc then
        if not freshv then
          -- the write's TTL below, of w = burst - 1, f = 0: x = p
          local q = floor(p / r)
          if q * r > p then q = q - 1 end
          if q * r < p then q = q + 1 end
          if q > HUGE then q = HUGE end
          -- (the TTL a string: Redis formats a number argument as a
          -- double on every call, about 0.15 µs of a SET's 1.5)
          freshv, freshpx = format('%d 0 %d -', burst - 1, now), format('%d', math.ceil(q / 1000) + 1000)
          freshout = format(' %d 0', burst - 1)
        end
        v = pcall('SET', kc, freshv, 'NX', 'GET', 'PX', freshpx)
        if type(v) == 'table' then v = pcall('GET', kc) elseif not v then fresh = true end
      else
        v = pcall('GET', kc)
      end
      if fresh then
        w, f, t, missing = burst - 1, 0, now, missing + 1 -- written: the call's grant, taken
      elseif not v then
        w, f, t, missing = burst, 0, now, missing + 1
      elseif type(v) == 'table' then
        errs = errs or {}
        errs[#errs + 1] = refused('GET', v)
        ej = #errs
      else
        missing = missing - 1
        local a, b, d = match(v, '^(-?%d+) (%d+) (%d+) %S')
        if not a then
          errs = errs or {}
          errs[#errs + 1] = 'ERR leaselimit: bucket ' .. kc .. ' holds an unknown value'
          ej = #errs
        else
          w, f, t = tonumber(a), tonumber(b), tonumber(d)
          -- refill to now (see refill in muldiv.lua)
          if w >= burst then
            w, f = burst, 0
            if now > t then t = now end
          elseif now > t then
            local x = (now - t) * r
            if x < MAX - f then -- muldiv's fast path
              x = x + f
              local q = floor(x / p)
              if q > 0 and q * p > x then q = q - 1 end
              local rem = x - q * p
              if rem >= p then q, rem = q + 1, rem - p end
              if q >= HUGE then q, rem = HUGE, 0 end -- muldiv's saturation, which refill compares
              if q >= burst - w then w, f = burst, 0 else w, f = w + q, rem end
              t = now
            else
              local _, _, refill = arith(MAX, HUGE, floor)
              w, f, t = refill(w, f, t, now, r, p, burst)
            end
          end
        end
      end
    end
    local want = wants[c]
    if want > 0 then -- an exact call
      j = j + 1
      if fresh then
        any = true
        out[c + 3] = freshout
      elseif ej then
        out[c + 3] = ' e ' .. ej
      elseif w >= want then
        w, took, any = w - want, true, true
        out[c + 3] = format(' %d %d', w, f)
      else
        out[c + 3] = format(' %d %d', w, -1 - f)
      end
    else -- a call with a min and a share, as the general path decides it
      local min, share = tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
      want, j = -want, j + 3
      if ej then
        out[c + 3] = ' e ' .. ej .. ' 0'
      else
        local g = 0
        if w >= min then
          g = min < want and portion(w, want, min, share) or want
          w, took, any = w - g, true, true
        end
        out[c + 3] = format(' %d %d %d', g, w, f)
      end
    end
  end
  if (any or always) and keyed and not lone then -- a lone call's claimed above
    local res = pcall('SET', KEYS[1], reply, 'PX', window)
    if res.err then return redis.error_reply(refused('SET', res)) end
  end
  return reply
end

-- int returns v as an integer in [1, 2^53), or nil.
local function int(v)
  v = tonumber(v)
  if v == nil or v ~= v or v % 1 ~= 0 or v < 1 or v >= MAX then return nil end
  return v
end

-- read returns the bucket at key: w, f, t, all nil for a missing key (a
-- full bucket); or, for one it could not read, nil and the error.
local function read(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then return nil, nil, nil, refused('GET', v) end
  if not v then return nil end
  local w, f, t = string.match(v, '^(-?%d+) (%d+) (%d+) %S')
  if not w then return nil, nil, nil, 'ERR leaselimit: bucket ' .. key .. ' holds an unknown value' end
  return tonumber(w), tonumber(f), tonumber(t)
end

-- write stores a bucket in one SET, with a TTL until it is full again
-- (reset µs from now; a missing key reads as full) plus a margin; it
-- returns the error of a refused write.
local function write(key, w, f, t, reset)
  local r = redis.pcall('SET', key, string.format('%d %d %d -', w, f, t), 'PX', math.ceil(reset / 1000) + 1000)
  if type(r) == 'table' and r.err then return refused('SET', r) end
  return nil
end

-- The general form: L limits, each call under one of them.
local _, until_tokens, refill = arith(MAX, HUGE, floor)
local window, L = int(ARGV[1]), int(ARGV[2])
if not ((window or not keyed) and L) or n < 1 or #ARGV < 2 + 3 * L then
  return redis.error_reply(BAD)
end

-- The limits: CAL[k] tells a calendar quota; A, B are r and p, or the
-- two window ends.
local CAL, A, B, S, BURST = {}, {}, {}, {}, {}
for k = 1, L do
  local i = 3 * k
  local a, b, burst = ARGV[i], int(ARGV[i + 1]), int(ARGV[i + 2])
  if string.byte(a, 1) == 119 then -- 'w<end>:<start>', as quota_ends in common.lua reads it
    local e, st = string.match(a, '^w(%d+):(%d+)$')
    a, st = tonumber(e), tonumber(st)
    if a == nil or st == nil or st < 1 or a <= st or a >= MAX or not b or b <= a then
      return redis.error_reply(BAD)
    end
    CAL[k], S[k] = true, st
  else
    a = int(a)
    CAL[k] = false
  end
  if not (a and b and burst) or burst > HUGE then return redis.error_reply(BAD) end
  A[k], B[k], BURST[k] = a, b, burst
end

local clock = redis.pcall('TIME')
if clock.err then return redis.error_reply(refused('TIME', clock)) end
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

-- arg reads the arguments of the call at ARGV[j + 1] of the general form:
-- its limit k, want, min and share_ppm (nil where one is bad), and the
-- last ARGV it read.
local function arg(j)
  local k, want = tonumber(ARGV[j + 1]), int(ARGV[j + 2])
  if k and k > L then
    return k - L, want, int(ARGV[j + 3]), int(ARGV[j + 4]), j + 4
  end
  return k, want, want, 1000000, j + 2
end

-- Every call's arguments are checked before any bucket is read or
-- written, so that a bad list leaves nothing behind.
local first = 2 + 3 * L -- the last ARGV before the calls'
local j = first
for _ = 1, n do
  local k, want, min, share
  k, want, min, share, j = arg(j)
  if not (k and want and min and share) or k % 1 ~= 0 or k < 1 or k > L
      or share > 1000000 or min > want or want > BURST[k] then
    return redis.error_reply(BAD)
  end
end
if #ARGV ~= j then return redis.error_reply(BAD) end

-- The bucket in hand: calls on one key that come one after another (the
-- client puts a batch's calls on one key together) are decided on one
-- reading of it, in order, and it is written once, when the next key
-- comes or the batch ends (see flush). sw, sf, st: its state as read, or
-- as its last grant left it (sw nil: missing, a full bucket); gk the limit
-- of that grant (0: none, nothing to write); ej the line of its read
-- error. A key that comes back after another is read again, and finds
-- what was decided for it written. No table holds the buckets: tables are
-- what a script pays most for per call, after GET and SET.
local key, sw, sf, st, gk, ej = nil, nil, nil, nil, 0, nil
local errs, any = nil, false
local out = {clock[1], ' ', clock[2]}

-- flush writes the bucket in hand if a call took from it, with a TTL until
-- it is full again (a missing key reads as full) plus a margin; it returns
-- the error of a refused write.
local function flush()
  if gk == 0 then return nil end
  local w, f, last, burst = sw, sf, st, BURST[gk]
  local reset = 0
  if w < burst then
    if CAL[gk] then
      reset = last - now
    else
      reset = until_tokens(burst - w, f, A[gk], B[gk])
    end
  end
  return write(key, w, f, last, reset)
end

j = first
for c = 1, n do
  local k, want, min, share
  k, want, min, share, j = arg(j)
  local kc = KEYS[c + base]
  if kc ~= key then
    local e = flush()
    if e then return redis.error_reply(e) end
    key, sw, sf, st, gk, ej = kc, nil, nil, nil, 0, nil
    local bad
    sw, sf, st, bad = read(kc)
    if bad then
      errs = errs or {}
      errs[#errs + 1] = bad
      ej = #errs
    end
  end

  if ej then
    out[c + 3] = ' e ' .. ej .. ' 0'
  else
    local cal, a, b, burst = CAL[k], A[k], B[k], BURST[k]
    local w, f, last = sw, sf, st
    if w == nil then w, f, last = burst, 0, now end
    -- Bring the bucket to now (advance in common.lua). A token bucket
    -- refills, capped at burst; a clock that went backwards refills
    -- nothing and keeps the later timestamp. A calendar quota whose window
    -- (last) has ended is full again for the window now is in; a window
    -- of the usual length from now if this server's clock is more than a
    -- window ahead of the client's.
    if cal then
      if now >= last then
        local cur = S[k]
        if now >= cur then cur = a end
        if now >= a then cur = b end
        if now >= cur then cur = now + (b - a) end
        w, last = burst, cur
      end
      f = 0
    else
      w, f, last = refill(w, f, last, now, a, b, burst)
    end

    local g = 0
    if w >= min then
      g = min < want and portion(w, want, min, share) or want
      w = w - g
      sw, sf, st, gk = w, f, last, k
      any = true
    end
    if cal then f = last end
    out[c + 3] = string.format(' %d %d %d', g, w, f)
  end
end
local reply = table.concat(out)
if errs then reply = reply .. '\n' .. table.concat(errs, '\n') end
if lone then
  local done, cmd = claim(KEYS[1], reply, any or always, string.format('%d', window))
  if done then
    if type(done) == 'table' then return redis.error_reply(refused(cmd, done)) end
    return done -- a resend: the first sending's reply, nothing written
  end
end
local e = flush()
if e then
  if lone then redis.pcall('DEL', KEYS[1]) end -- its claim (see claim)
  return redis.error_reply(e)
end
if (any or always) and keyed and not lone then
  local r = redis.pcall('SET', KEYS[1], reply, 'PX', string.format('%d', window))
  if type(r) == 'table' and r.err then return redis.error_reply(refused('SET', r)) end
end
return reply
