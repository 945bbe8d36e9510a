package leaselimit

import (
	"errors"
	"fmt"

	"github.com/leaselimit/leaselimit/policy"
)

// view is what a Limiter decides that its limits and their state do not:
// what the failure policy does, and which keys are enforced. Every view of
// one set of limits shares their buckets, leases and FailLocal buckets (see
// With); NewClient's options set the default view.
type view struct {
	mode    policy.FailureMode // WithFailureMode
	enforce float64            // WithEnforce: the share of keys whose decisions are enforced
}

// viewOption is an option of a view: given to NewClient it sets the default
// of every Limiter, given to With one view's. name is the option's name,
// for errors.
type viewOption struct {
	name string
	set  func(*view) error
}

func (o viewOption) apply(c *config) error { return optionFailed(o.name, o.set(&c.view)) }

// WithFailureMode sets what a Limiter decides while Redis is unavailable:
// given to NewClient, every Limiter's default; given to Limiter.With, one
// view's (a login limit that fails closed beside a product limit that fails
// open, on one Client). Default policy.FailOpen.
func WithFailureMode(m policy.FailureMode) Option {
	return viewOption{"WithFailureMode", func(v *view) error {
		if err := m.Validate(); err != nil {
			return err
		}
		v.mode = m
		return nil
	}}
}

// With returns a view of the same limits as l (the same buckets, leases,
// negative cache and FailLocal buckets) with other view options: exactly
// WithFailureMode, WithShadow and WithEnforce, applied in order over l's.
// Any other option gives a Limiter whose calls all return an error naming
// it: those are the Client's (NewClient). So does an invalid option value,
// such as WithEnforce(2).
//
//	login := c.Limiter(loginLimit).With(leaselimit.WithFailureMode(policy.FailClosed))
//	trial := c.Limiter(newLimit).With(leaselimit.WithShadow())
//
// What the failure policy admits is charged to the limits' buckets once
// Redis is back, whichever view admitted it; under policy.FailLocal every
// view of a limit draws on the same local share of each key.
//
// With allocates a new Limiter: make the views you need once and keep
// them, rather than calling With per request (Client.Limiter, by contrast,
// is meant to be called per request). A view has no Close: Close the Client.
func (l *Limiter) With(opts ...Option) *Limiter {
	if err := l.present(); err != nil {
		return &Limiter{err: err} // a nil or zero Limiter's view: every call returns err
	}
	v := *l
	v.owner = false
	if v.err != nil {
		return &v
	}
	for _, o := range opts {
		switch o := o.(type) {
		case nil:
		case viewOption:
			if err := optionFailed(o.name, o.set(&v.view)); err != nil {
				return v.refused(err)
			}
		case engineOption:
			return v.refused(optionError{fmt.Errorf("leaselimit: With(%s): %s is an option of the Client (give it to NewClient), not of a view; With takes WithFailureMode, WithShadow and WithEnforce", o.name, o.name)})
		default:
			return v.refused(optionError{fmt.Errorf("leaselimit: With(%T): not an option of a view; With takes WithFailureMode, WithShadow and WithEnforce", o)})
		}
	}
	return &v
}

// refused returns v, a view With made, refusing every call with err, and
// logs it.
func (v *Limiter) refused(err error) *Limiter {
	v.err = err
	v.engine.refusing(err)
	return v
}

// ErrInvalidOption is wrapped by NewClient's error for an option it
// refused, and by the error of every call of a view that With refused (an
// option of the Client, or an invalid value): a mistake in the program,
// like policy.ErrInvalidLimit, not an outage to retry. The error names the
// option.
var ErrInvalidOption = errors.New("leaselimit: invalid option")

// optionError is the error of a view made with an option it cannot take:
// the caller's mistake, like an invalid limit (see callerError).
type optionError struct{ error }

func (e optionError) Unwrap() []error { return []error{ErrInvalidOption, e.error} }
