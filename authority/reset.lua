-- leaselimit reset: make a bucket full again and start its next generation.
--
-- KEYS[1]  the bucket (see common.lua)
-- KEYS[2]  its reset mark: the server's clock (µs) at the reset
-- KEYS[3]  the reset's id key: it holds the mark this reset set, for
--          ARGV[2] ms. Absent with ARGV[2] 0: the form for a Cluster slot
--          in migration, where a key that does not exist yet (an id key
--          never does) is refused; a resend of it resets again.
-- ARGV[1]  the mark's life in ms
-- ARGV[2]  the id key's life in ms, or 0
-- Returns  the mark.
--
-- The bucket is deleted (a missing bucket is full). The mark tells the
-- refund script which tokens left the bucket before the reset: those are
-- not given back to (nor charged to) the fresh bucket. A mark outlives
-- every adjustment leaselimit may still send for tokens taken before it,
-- but for a Reservation kept unsettled for longer than its life.
--
-- Once: a reset sent again (go-redis resends a call whose connection broke
-- after Redis ran it) finds its id key and returns the mark it set,
-- changing nothing. Run twice, it would delete the fresh bucket again, and
-- the fleet would admit its burst once more for every resend.
local life, keyed = int(1), ARGV[2] ~= '0'
local id_life = keyed and int(2)
if not life or keyed and not id_life then
  return redis.error_reply('ERR leaselimit: invalid reset arguments')
end
local done, err
if keyed then
  done, err = call('GET', KEYS[3])
  if err then return err end
  if done then
    return tonumber(done)
  end
end
local now, _
now, err = now_us()
if err then return err end
_, err = call('DEL', KEYS[1])
if err then return err end
_, err = call('SET', KEYS[2], int_str(now), 'PX', int_str(life))
if err then return err end
if keyed then
  _, err = call('SET', KEYS[3], int_str(now), 'PX', int_str(id_life))
  if err then return err end
end
return now
