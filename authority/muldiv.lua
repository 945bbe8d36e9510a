-- leaselimit arithmetic prelude, prepended to every script: exact
-- integer arithmetic in Lua's doubles, and a token bucket's refill by it.
-- Every number the scripts handle is an integer below 2^53 (MAX), exact in
-- a double; products that could pass it (elapsed µs × r, tokens × p) go
-- through muldiv, which is exact and saturates its quotient at HUGE
-- (2^52), far above any burst.
local MAX = 9007199254740992
local HUGE = 4503599627370496
local floor = math.floor

-- arith returns muldiv, until_tokens and refill (below), made when it is
-- called. A script's local functions are made anew on every invocation,
-- and one that captures the script's locals (these capture MAX, HUGE, floor
-- and one another) costs allocations each time it is made; arith captures
-- none. So a script pays for the arithmetic only where it calls arith: the
-- batch script's usual path only for products past 2^53 (see batch.lua).
local function arith(MAX, HUGE, floor)
  -- muldiv returns floor((a*b + f)/c) and (a*b + f) % c exactly, for
  -- 0 <= a, b, f < 2^53 and 1 <= c < 2^53; a quotient of HUGE or more comes
  -- back as HUGE (remainder 0). Products past 2^53 (huge rates and periods)
  -- take the slow path, whose functions are made only when first needed.
  local slow
  local function muldiv(a, b, f, c)
    local x = a * b
    -- A product of 2^53 or more computes as at least 2^53, so this test
    -- never passes wrongly.
    if x < MAX - f then
      x = x + f
      local q = floor(x / c)
      if q > 0 and q * c > x then q = q - 1 end
      local r = x - q * c
      if r >= c then q, r = q + 1, r - c end
      if q >= HUGE then return HUGE, 0 end
      return q, r
    end
    if not slow then
      local function divmod(a, c)
        local q = floor(a / c)
        if q > 0 and q * c > a then q = q - 1 end
        local r = a - q * c
        if r >= c then q, r = q + 1, r - c end
        return q, r
      end
      -- addmod: the carry and (r + x) % c, never forming a sum above c.
      local function addmod(r, x, c)
        if r >= c - x then return 1, r - (c - x) end
        return 0, r + x
      end
      slow = function(a, b, f, c)
        local qa, ra = divmod(a, c)
        local q, r = divmod(f, c)
        if qa > 0 then
          if b >= HUGE / qa then return HUGE, 0 end
          q = q + qa * b
          if q >= HUGE then return HUGE, 0 end
        end
        -- ra*b by doubling over the bits of b, reduced mod c at every step.
        local hq, hr, bit = 0, 0, HUGE
        while bit >= 1 do
          local carry
          carry, hr = addmod(hr, hr, c)
          hq = hq * 2 + carry
          if b >= bit then
            b = b - bit
            carry, hr = addmod(hr, ra, c)
            hq = hq + carry
          end
          if hq >= HUGE then return HUGE, 0 end
          bit = bit / 2
        end
        local carry
        carry, r = addmod(r, hr, c)
        q = q + hq + carry
        if q >= HUGE then return HUGE, 0 end
        return q, r
      end
    end
    return slow(a, b, f, c)
  end

  -- until_tokens returns the µs until a bucket holding w + f/p tokens holds m
  -- more whole tokens (m >= 1): ceil((m*p - f) / r), at most HUGE.
  local function until_tokens(m, f, r, p)
    local q, rem = muldiv(m - 1, p, p - f, r)
    if q >= HUGE then return HUGE end
    if rem > 0 then q = q + 1 end
    return q
  end

  -- refill brings the bucket (w, f at last) to now, capped at burst. A clock
  -- that went backwards (failover to a server with another clock) refills
  -- nothing and keeps the later timestamp.
  local function refill(w, f, last, now, r, p, burst)
    if w >= burst then return burst, 0, math.max(last, now) end
    if now > last then
      local q, rem = muldiv(now - last, r, f, p)
      if q >= burst - w then
        w, f = burst, 0
      else
        w, f = w + q, rem
      end
      last = now
    end
    return w, f, last
  end
  return muldiv, until_tokens, refill
end
