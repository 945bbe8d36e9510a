-- leaselimit reset: make a bucket full again and start its next generation.
--
-- KEYS[1]  the bucket (see common.lua)
-- KEYS[2]  its reset mark: the server's clock (µs) at the reset
-- ARGV[1]  the mark's life in ms
-- Returns  the mark.
--
-- The bucket is deleted (a missing bucket is full). The mark tells the
-- refund script which tokens left the bucket before the reset: those are
-- not given back to (nor charged to) the fresh bucket. A mark outlives
-- every adjustment leaselimit may still send for tokens taken before it,
-- but for a Reservation kept unsettled for longer than its life.
local life = int(1)
if not life then
  return redis.error_reply('ERR leaselimit: invalid reset arguments')
end
local now, err = now_us()
if err then return err end
local _
_, err = call('DEL', KEYS[1])
if err then return err end
_, err = call('SET', KEYS[2], int_str(now), 'PX', int_str(life))
if err then return err end
return now
