-- leaselimit refund batch: give unused tokens back to many buckets of one
-- limit in one call, applied at most once per call: the refunds a refund
-- queue sends of its own accord (a lease table's expired and evicted
-- leases, on every janitor tick; grants no caller took), which no caller
-- resends under an id of its own.
-- Adjustments that have one (a Settle's, a charge) go through refund.lua,
-- each applied once by its own id key; here one id key per call does, so
-- a refund costs Redis a read of its bucket (and of its reset mark when
-- the bucket is there) and a write when it changes the bucket, not a key
-- of its own that lives IDLife (on the comparison's cold long tail, two
-- million of them).
--
-- KEYS[1]  the call's id key: it exists once the call was applied, for
--          ARGV[1] ms. A call sent again (go-redis resends a call whose
--          connection broke; leaselimit one whose outcome it does not know,
--          with the same adjustments or fewer, never others) returns '='
--          and applies nothing.
-- KEYS[2j], KEYS[2j+1]  adjustment j's bucket and its reset mark (see
--          reset.lua), j from 1. A bucket may come more than once: it is
--          read once, adjusted in order and written once.
-- ARGV[1]  the id key's life in ms
-- ARGV[2], ARGV[3], ARGV[4]  r, p (or a calendar quota's windows), burst:
--          the limit of every bucket of the call (as in refund.lua)
-- ARGV[3j+2], ARGV[3j+3], ARGV[3j+4]  adjustment j's n (1 <= n <= burst),
--          window and since, as in refund.lua.
-- Returns  '=' for a call applied before; else one character per
--          adjustment, '+' applied (or dropped by the ledger rule: a Reset
--          since its tokens left, or another window; or nothing to do: a
--          full or missing bucket) and 'e' failed (its arguments are
--          invalid, or its bucket, or the mark of a bucket that is there,
--          holds a value not ours: it is not applied, and sending it again
--          would fail the same way),
--          then, for each 'e' in order, a newline and its error.
--
-- The call's adjustments are decided on reads alone, then the id key is
-- written (unless every refund failed), then the buckets: a call that Redis refuses (OOM, a read-only
-- replica) writes nothing, and one whose id key was written writes every
-- bucket (Redis decides a script's OOM state once, as it starts).
local invalid = redis.error_reply('ERR leaselimit: invalid refund batch arguments')
local count = (#ARGV - 4) / 3
if count < 1 or count % 1 ~= 0 or #KEYS ~= 2 * count + 1 then return invalid end
local life = int(1)
local cal, a, b, s = spec(2)
local burst = int(4)
if not life or cal == nil or not burst or burst > HUGE then return invalid end

local done, err = call('GET', KEYS[1])
if err then return err end
if done then return '=' end
local now
now, err = now_us()
if err then return err end

-- The buckets found as the adjustments leave them, by key: read once. A
-- missing bucket is full, and stays so for the call (a refund only adds):
-- its refunds have nothing to do, and its reset mark is not read (on the
-- comparison's cold long tail most refunds find their bucket gone, full
-- again, and a read of the mark cost Redis as much as the rest).
local state, order, codes, errors = {}, {}, {}, {}
for j = 1, count do
  local o = 3 * j + 1
  local n, window, since = int(o + 1), tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])
  local key, mark_key = KEYS[2 * j], KEYS[2 * j + 1]
  local st = state[key]
  local fail
  if not n or n > burst or not window or window ~= window or window < 0 or not since or since ~= since or since < 0 then
    fail = invalid -- this adjustment alone
  elseif st == nil then
    local found, lerr, w0, f0, t0, rid, tail = load(key)
    local mark
    if found then mark, lerr = call('GET', mark_key) end
    if lerr then
      fail = lerr
    elseif mark and not tonumber(mark) then
      fail = redis.error_reply('ERR leaselimit: reset mark ' .. mark_key .. ' holds an unknown value')
    elseif not found then
      st = false
      state[key] = st
    else
      local w, f, last = advance(cal, w0, f0, t0, now, a, b, burst, s)
      st = {w = w, f = f, last = last, rid = rid, tail = tail, mark = tonumber(mark), dirty = false}
      state[key] = st
      order[#order + 1] = key
    end
  end
  if fail then
    codes[j] = 'e'
    errors[#errors + 1] = fail.err
  else
    codes[j] = '+'
    -- The ledger rule (see refund.lua): not to a bucket Reset since the
    -- tokens left, nor of tokens older than a mark lives, nor to another
    -- window. A full bucket, or a missing
    -- one (st false), has nothing to do; one the refund fills is
    -- deleted, as it reads the same.
    if st and st.w < burst and not (st.mark and since <= st.mark) and not (cal and window ~= st.last) and not stale(n, since, now) then
      st.w = math.min(st.w + n, burst)
      st.dirty = true
    end
  end
end

local reply = table.concat(codes)
local applied = string.find(reply, '+', 1, true)
if #errors > 0 then reply = reply .. '\n' .. table.concat(errors, '\n') end
-- A call that applied nothing records nothing: every one of its refunds
-- failed, and comes back to be dropped. One whose refunds all found their
-- bucket full (missing) records its id all the same: sent again once
-- another instance drained the bucket, it would add what the bucket could
-- not hold the first time.
-- (The codes alone are searched: an error names keys, whose prefix and
-- limit name may hold a '+'.)
if not applied then return reply end
local _
_, err = call('SET', KEYS[1], '1', 'PX', int_str(life))
if err then return err end
for _, key in ipairs(order) do
  local st = state[key]
  if st.dirty then
    if st.w >= burst then
      _, err = call('DEL', key)
    else
      err = store(key, st.w, st.f, st.last, st.rid, st.tail, ttl_ms(wait(cal, burst - st.w, st.f, st.last, now, a, b)))
    end
    if err then return err end
  end
end
return reply
