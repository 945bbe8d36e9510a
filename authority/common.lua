-- leaselimit common prelude, prepended to acquire_all.lua, refund.lua,
-- refund_batch.lua, reset.lua and peek.lua (batch.lua stands alone, with copies of the few
-- helpers it needs).
--
-- A limit refills r tokens every p µs (its rate and period reduced by their
-- gcd), up to burst tokens. A bucket is one string,
-- "<w> <f> <t> <rid>" (batch.lua writes "<w> <f> <t> -") or, as acquire
-- scripts before batch.lua wrote it, "<w> <f> <t> <rid> <id> <granted> <remaining> <reset>":
-- the bucket holds w + f/p tokens (w whole, negative for a bucket in debt
-- (see refund.lua), 0 <= f < p), valid at t µs on
-- this server's clock; rid, a field kept for the format (refunds once
-- recorded their last id there; ids now live in keys of their own,
-- see refund.lua), passed through as it is; then, in the old form, the
-- request id of the bucket's last grant and that grant's reply, now unused
-- (a batch's resend is answered from its batch key, see batch.lua). It is written by one SET ... PX, so the state never
-- exists without its TTL, and a refused write leaves nothing behind. A
-- missing key is a full bucket.
--
-- Every number is an integer below 2^53, exact in Lua's doubles (see
-- muldiv.lua, prepended to this file).

-- MARK_LIFE_US is a reset mark's life in µs (authority.MarkLife: reset.lua
-- is given it as ARGV[1]). A refund of tokens that left their bucket
-- longer ago than this is dropped: a Reset since then may have left a mark
-- that is gone, and the tokens are likely of an older generation; a bucket
-- whose mark expired cannot tell (a Reservation settled later than that
-- after its grant, across a Reset, gave its surplus to the fresh bucket).
local MARK_LIFE_US = 604800000000

-- stale reports whether a refund (n > 0) of tokens that left their bucket
-- at since (µs, 0 if unknown) is past a mark's life at now.
local function stale(n, since, now)
  return n > 0 and since > 0 and now - since >= MARK_LIFE_US
end

-- The arithmetic (see arith in muldiv.lua): these scripts use refill and
-- until_tokens on every call.
local _, until_tokens, refill = arith(MAX, HUGE, floor)

-- int returns ARGV[i] as an integer in [1, 2^53), or nil.
local function int(i)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= v or v % 1 ~= 0 or v < 1 or v >= MAX then return nil end
  return v
end

-- call runs a Redis command; a refusal (an ACL without it, OOM, a read-only
-- replica) comes back as an error reply that names the command, with
-- Redis's own error code first so that callers classify it as Redis meant.
local function call(cmd, ...)
  local r = redis.pcall(cmd, ...)
  if type(r) == 'table' and r.err then
    return nil, redis.error_reply(r.err .. ' (leaselimit: Redis refused ' .. cmd .. ' in the script)')
  end
  return r
end

-- now_us reads the server's clock in microseconds.
local function now_us()
  local clock, err = call('TIME')
  if err then return nil, err end
  return tonumber(clock[1]) * 1000000 + tonumber(clock[2])
end

-- int_str formats an integer below 2^53 without an exponent (%d: Redis's
-- Lua converts to a 64-bit integer, exact below 2^53, and formats it at half
-- the cost of %.0f).
local function int_str(v)
  return string.format('%d', v)
end

-- load reads the bucket at key: found false for a missing (full) bucket,
-- else found true and w, f, t, rid, tail, tail being the grant part
-- (" <id> <granted> <remaining> <reset>" or ""). The fields come back as
-- values, not a table: this runs once per decision.
local function load(key)
  local v, err = call('GET', key)
  if err then return false, err end
  if not v then return false end
  local w, f, t, rid, tail = string.match(v, '^(-?%d+) (%d+) (%d+) (%S+)(.*)$')
  if not w then
    return false, redis.error_reply('ERR leaselimit: bucket ' .. key .. ' holds an unknown value')
  end
  return true, nil, tonumber(w), tonumber(f), tonumber(t), rid, tail
end

-- store writes the bucket at key with a TTL of ttl_ms, in one command.
local function store(key, w, f, t, rid, tail, ttl_ms)
  local v = string.format('%d %d %d %s%s', w, f, t, rid, tail)
  local _, err = call('SET', key, v, 'PX', int_str(ttl_ms))
  return err
end

-- valid_id reports whether id can be stored in a bucket: 1 to 64 bytes, no
-- white space.
local function valid_id(id)
  return #id > 0 and #id <= 64 and not string.find(id, '%s')
end

-- quota_ends reads a calendar quota's 'w<end>:<start>' (see spec): the
-- end and the start of the client's window, or nil.
local function quota_ends(v)
  local e, s = string.match(v, '^w(%d+):(%d+)$')
  e, s = tonumber(e), tonumber(s)
  if e == nil or s == nil or s < 1 or e <= s or e >= MAX then return nil end
  return e, s
end

-- spec reads the kind of a bucket at ARGV[i] and ARGV[i+1]: r and p of a
-- token bucket, or 'w<end>:<start>' and next for a calendar quota (in µs
-- on the client's clock, the end and the start of the window it is in and
-- the end of the one after; this server's clock picks one of the three
-- ends: the start is the end of the window before). It returns cal (a
-- calendar quota or not) and the two numbers, and a quota's start; or nil.
local function spec(i)
  local a = ARGV[i]
  if a ~= nil and string.byte(a, 1) == 119 then -- 'w'
    local e, s = quota_ends(a)
    local n = int(i + 1)
    if not e or not n or n <= e then return nil end
    return true, e, n, s
  end
  local r, p = int(i), int(i + 1)
  if not (r and p) then return nil end
  return false, r, p
end

-- advance brings a bucket (w + f/p tokens at last) to now. A token bucket
-- refills (a, b are r, p). For a calendar quota (a, b are the ends of two
-- windows, s the start of the first) last is the end of the window w
-- belongs to: once it has passed, the bucket is full again (a debt is
-- forgiven), for the window now is in: the one before the client's when
-- this server's clock is behind it.
local function advance(cal, w, f, last, now, a, b, burst, s)
  if not cal then return refill(w, f, last, now, a, b, burst) end
  if now >= last then
    local cur = s
    if now >= s then cur = a end
    if now >= a then cur = b end
    -- This server's clock is more than a window ahead of the client's:
    -- a window of the usual length from now, so the bucket ends in the
    -- future (a TTL, a reset-after above zero) whatever the skew.
    if now >= cur then cur = now + (b - a) end
    return burst, 0, cur
  end
  return w, 0, last
end

-- wait returns the µs until a bucket advanced to now (see advance) holds m
-- more whole tokens (m >= 1): its refill time for a token bucket, the end
-- of its window for a calendar quota.
local function wait(cal, m, f, last, now, a, b)
  if cal then return last - now end
  return until_tokens(m, f, a, b)
end

-- ttl_ms is how long a bucket lives: until it would be full again (a
-- missing key reads as full), reset µs from now, plus a margin.
local function ttl_ms(reset)
  return math.ceil(reset / 1000) + 1000
end

