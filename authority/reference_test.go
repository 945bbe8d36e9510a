package authority

import (
	"fmt"
	"time"
)

// The reference for the batch script: the acquire script it replaced
// (common.lua, then take(), then one call), kept as it was, and the decoding
// of its reply. The differential tests decide the same calls with both and
// want identical grants and buckets.

// refAcquireSrc is the replaced acquire script: ARGV r, p (or a calendar
// quota's windows), burst, want, min, share_ppm and an optional request id;
// reply {granted, remaining, retry_after_us, reset_after_us, now}.
var refAcquireSrc = commonSrc + refTakeSrc + refAcquireBody

// refAcquireManySrc is the replaced acquire_many script (for the Redis CPU
// comparison in bench_test.go): 7 ARGV per call, one reply per call.
var refAcquireManySrc = commonSrc + refTakeSrc + refAcquireManyBody

const refAcquireManyBody = `-- leaselimit acquire_many: several acquire calls in one script invocation,
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
`

const refTakeSrc = `
-- take decides one acquire call on key at now (µs, the server's clock),
-- its arguments at ARGV[base+1 .. base+7]: r, p (or a calendar quota's
-- windows, see spec), burst, want, min, share_ppm (all integers), and
-- optionally a request id (see acquire.lua).
-- It returns the reply {granted, remaining, retry_after_us, reset_after_us,
-- now}, or nil and an error reply. now stamps the grant for the ledger: a
-- token given back later is applied only if it left the bucket after the
-- bucket's last reset (see refund.lua). A resent call's stored reply has
-- four elements: when its tokens left is not known.
local function take(key, base, now)
  local cal, a, b, s = spec(base + 1)
  local burst, want, min, share = int(base + 3), int(base + 4), int(base + 5), int(base + 6)
  if cal == nil or not (burst and want and min and share)
      or share > 1000000 or min > want or want > burst or burst > HUGE then
    return nil, redis.error_reply('ERR leaselimit: invalid acquire arguments')
  end
  local id = ARGV[base + 7]
  if id ~= nil and not valid_id(id) then
    return nil, redis.error_reply('ERR leaselimit: invalid acquire arguments')
  end

  local found, err, bw, bf, bt, rid, btail = load(key)
  if err then return nil, err end
  -- A replay only when the tail starts with this call's id (compared
  -- before any pattern is matched: almost every call is new).
  if found and id ~= nil and string.sub(btail, 2, #id + 1) == id then
    local tid, g, rem, t = string.match(btail, '^ (%S+) (%d+) (%d+) (%d+)$')
    if tid == id then return {tonumber(g), tonumber(rem), 0, tonumber(t)} end
  end
  local w, f, last = burst, 0, now
  if found then w, f, last = bw, bf, bt end
  w, f, last = advance(cal, w, f, last, now, a, b, burst, s)

  local granted = 0
  if w >= min then
    -- floor(w * share / 1e6), exactly: split w so no product passes 2^53.
    granted = math.floor(w / 1000000) * share + math.floor((w % 1000000) * share / 1000000)
    if granted < min then granted = min end
    if granted > want then granted = want end
    w = w - granted
  end

  local reset = 0
  if w < burst then reset = wait(cal, burst - w, f, last, now, a, b) end
  if granted > 0 then
    local tail = ''
    if id ~= nil then
      tail = string.format(' %s %d %d %d', id, granted, w, reset)
    end
    if not found then rid = '-' end
    err = store(key, w, f, last, rid, tail, ttl_ms(reset))
    if err then return nil, err end
  end

  local retry = 0
  if granted == 0 then
    retry = wait(cal, min - w, f, last, now, a, b)
  end
  return {granted, w, retry, reset, now}
end
`

const refAcquireBody = `-- leaselimit acquire: take between min and want tokens from a token bucket.
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
`

// decodeRefGrant decodes an acquire reply: an array of four non-negative
// integers {granted, remaining, retry_after_us, reset_after_us} and, but
// for a resent call's stored reply, a fifth: the server's clock (µs) at the
// grant, Grant.At.
func decodeRefGrant(v any) (Grant, error) {
	var n [5]int64
	k := 5
	if arr, ok := v.([]any); ok && len(arr) == 4 {
		k = 4
	}
	if err := decodeInts(v, n[:k], 1); err != nil {
		return Grant{}, err
	}
	const maxMicros = int64(1<<63-1) / int64(time.Microsecond)
	if n[2] > maxMicros || n[3] > maxMicros {
		return Grant{}, fmt.Errorf("%w: duration out of range in %v", ErrReply, v)
	}
	if n[0] > 0 && n[2] != 0 {
		return Grant{}, fmt.Errorf("%w: granted %d with retry-after %dµs", ErrReply, n[0], n[2])
	}
	return Grant{
		Granted:    n[0],
		Remaining:  max(n[1], 0), // a bucket in debt holds none
		RetryAfter: time.Duration(n[2]) * time.Microsecond,
		ResetAfter: time.Duration(n[3]) * time.Microsecond,
		At:         n[4],
	}, nil
}
