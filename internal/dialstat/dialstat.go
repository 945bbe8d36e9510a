// Package dialstat tells, from a go-redis pool's statistics, whether its
// dials fail. go-redis retries a failed dial until the call's deadline and
// reports the deadline, so a refused dial (a wrong address, Redis down)
// looks like a Redis that does not answer; the pool's counts tell them
// apart: a pool that needed connections and opened none could not dial,
// while a silent Redis's connections were opened (and perhaps removed at
// their deadlines).
package dialstat

import "github.com/redis/go-redis/v9"

// Mark is a pool's counts at one look: how often it needed a new
// connection (Misses), and how many connections it has opened, open or
// removed since (Made).
type Mark struct{ Misses, Made uint32 }

// Of returns st's counts.
func Of(st *redis.PoolStats) Mark {
	return Mark{Misses: st.Misses, Made: st.TotalConns + st.StaleConns}
}

// Failing reports whether, between m and now, the pool needed new
// connections and opened none: every dial failed.
func (m Mark) Failing(now Mark) bool { return now.Misses > m.Misses && now.Made == m.Made }
