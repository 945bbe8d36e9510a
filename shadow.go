package leaselimit

import (
	"fmt"
	"math"

	"github.com/cespare/xxhash/v2"
)

// WithShadow puts a view in shadow mode (dry run), to roll a new limit out
// safely: given to Limiter.With, that view; given to NewClient, every
// Limiter by default. Every decision is computed, counted and traced as
// usual, and marked as shadow (Decision.Shadow, ratelimit.shadow on spans
// and metrics), but every request is admitted; Decision.ShadowDenied says
// the limit would have denied it. It is WithEnforce(0).
//
// What a shadow decision consumes: an admission takes its tokens from the
// bucket as an enforced one does, and a would-be denial takes nothing, so
// the bucket is where it would be had the limit been enforced, and turning
// enforcement on later starts from an honest state.
func WithShadow() Option { return WithEnforce(0) }

// WithEnforce enforces decisions for a deterministic share of keys (0 to
// 1, by a digest of the key: the same keys on every instance and for every
// limit) and shadows the rest (see WithShadow), for a percentage rollout:
// WithEnforce(0.1) enforces one key in ten. Given to NewClient it sets
// every Limiter's default; given to Limiter.With, one view's:
// c.Limiter(newLimit).With(WithEnforce(0)) tries a new limit in shadow mode
// while the others stay enforced. Default 1, every key enforced.
func WithEnforce(share float64) Option {
	return viewOption{"WithEnforce", func(v *view) error {
		if err := validShare("WithEnforce", share); err != nil {
			return err
		}
		v.enforce = share
		return nil
	}}
}

// validShare checks a share of keys to enforce, given to fn.
func validShare(fn string, share float64) error {
	if math.IsNaN(share) || share < 0 || share > 1 {
		return fmt.Errorf("leaselimit: %s(%v): want a share between 0 and 1", fn, share)
	}
	return nil
}

// enforced reports whether key's decisions are enforced under l's share:
// keys whose 64-bit xxHash digest (XXH64, seed 0: the same on every
// instance, for every limit and in every version) falls in the lowest share
// of its range. The digest must mix every byte into every bit: keys that
// share a prefix (user:1, user:2, ...) must spread evenly, which the raw
// top bits of FNV-1a did not (0.5 enforced 0.795 of 2000 keys user:%d).
func (l *Limiter) enforced(key string) bool {
	switch {
	case l.enforce >= 1:
		return true
	case l.enforce <= 0:
		return false
	}
	return float64(xxhash.Sum64String(key)) < l.enforce*float64(math.MaxUint64)
}

// shadowed turns the decision d of a key in shadow into what the caller is
// told: admitted, with what the limit decided in ShadowDenied.
func shadowed(d Decision) Decision {
	d.Shadow = true
	if !d.Allowed {
		d.Allowed, d.ShadowDenied, d.RetryAfter, d.shadowRetry = true, true, 0, d.RetryAfter
	}
	return d
}
