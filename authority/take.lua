
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
  local cal, a, b = spec(base + 1)
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
  w, f, last = advance(cal, w, f, last, now, a, b, burst)

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
