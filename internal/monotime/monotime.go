// Package monotime keeps times as int64 nanoseconds that a step of the
// wall clock does not move. An NTP step, or a VM restored from a snapshot,
// moves time.Now's wall reading by any amount, backwards too; a time kept
// as UnixNano and compared with a later reading moved with it: a breaker
// stored when it would let probes through that way and, the clock stepped
// back by 30 s, rejected every call for 30 s while Redis answered, the
// failure policy deciding millions of requests. time.Now's readings carry
// the monotonic clock too, and Time.Sub uses it when both times have it.
package monotime

import "time"

// origin is the reading the others are measured from.
var origin = time.Now()

// Of returns t as nanoseconds since the process's origin: on the monotonic
// clock when t has a monotonic reading (time.Now's readings have one, and
// so do times made from them with Add), on the wall clock otherwise (a
// test's clock, stepped by hand, whose readings then order by their wall
// times as before). Only a reading at the origin itself is 0, so 0 may
// stand for "never".
func Of(t time.Time) int64 { return int64(t.Sub(origin)) }

// Now returns Of(time.Now()).
func Now() int64 { return int64(time.Since(origin)) }

// Time returns the time whose Of is n: a reading with a monotonic part,
// which compares with time.Now's readings on the monotonic clock.
func Time(n int64) time.Time { return origin.Add(time.Duration(n)) }
