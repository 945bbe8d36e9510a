package authority

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/leaselimit/leaselimit/internal/deadline"
	"github.com/redis/go-redis/v9"
)

// How the scripts' calls reach Redis: EVALSHA, then EVAL for a server that
// has not cached the script; a call whose reply the client stopped
// waiting for sent again while it is safe and the caller's deadline
// allows; and a timeout at that deadline reported as the deadline's.

// invocation is one script call of a pipeline: its keys and arguments,
// then, once sent, its command holding the reply.
type invocation struct {
	keys []string
	args []any
	// line, if set, is room for the whole command, args in it after the
	// keys (see command): a batch of one call makes it with the call. It
	// is lent to the first command only (lent).
	line []any
	lent bool
	cmd  *redis.Cmd
	// resendable marks a call that carries an id of its own (a batch's
	// resend key, an adjustment's id): sent twice, Redis applies it once
	// and answers the second with the first's outcome.
	resendable bool
}

// maxResends bounds how often runAll sends a call again after the client
// gave up on its reply (see clientTimedOut). Each send waited out the
// client's own timeout, so four more give a reply a few round trips to
// come back in, without a client whose timeout is tiny sending a call to
// Redis hundreds of times within one budget.
const maxResends = 4

// runAll sends every invocation of s by EVALSHA, in one pipeline when
// there are several. Those the server answers NOSCRIPT (after SCRIPT
// FLUSH, a restart or a failover) go again in a second pipeline: the first
// of them by EVAL, which caches the script, the others by EVALSHA, which
// then finds it on that node (a pipeline runs in order); any still
// answered NOSCRIPT (on a Cluster, other nodes) go by EVAL in a third.
// Sending the source with every invocation would cost Redis a SHA1 of the
// whole script each time: thousands of refunds flushed at once took longer
// than the time budget.
//
// A resendable invocation whose reply the client gave up on while ctx was
// still live goes again, under its id, up to maxResends times: a go-redis
// ReadTimeout shorter than the caller's deadline (a review: 1ms, with
// MaxRetries -1) otherwise made each late reply a failure, the breaker
// opened while Redis answered, and FailOpen admitted 21-71 times the
// bound. An invocation whose reply ctx's deadline cut reports ctx's error
// (see atDeadline). Each invocation's reply or error is then in its cmd.
func (r *Redis) runAll(ctx context.Context, s script, invs []*invocation) {
	r.sendAll(ctx, s, invs)
	for range maxResends {
		var again []*invocation
		for _, in := range invs {
			if in.resendable && clientTimedOut(in.cmd.Err()) {
				again = append(again, in)
			}
		}
		// ctx is looked at only when there is something to resend: most
		// calls are answered, and reading the clock for them is waste.
		if len(again) == 0 || deadline.Ended(ctx) != nil {
			break
		}
		r.sendAll(ctx, s, again)
	}
	for _, in := range invs {
		if err := in.cmd.Err(); err != nil {
			if e := atDeadline(ctx, err); e != err {
				in.cmd.SetErr(e)
			}
		}
	}
}

// sendAll sends invs once (see runAll), a lone invocation without a
// pipeline.
func (r *Redis) sendAll(ctx context.Context, s script, invs []*invocation) {
	if len(invs) == 1 {
		in := invs[0]
		in.cmd = in.command(ctx, "evalsha", s.shaArg)
		_ = r.client.Process(ctx, in.cmd) // the error is the command's
		if isNoScript(in.cmd.Err()) {
			in.cmd = in.command(ctx, "eval", s.srcArg)
			_ = r.client.Process(ctx, in.cmd)
		}
		return
	}
	pipe := r.client.Pipeline()
	for _, in := range invs {
		in.cmd = in.command(ctx, "evalsha", s.shaArg)
		_ = pipe.Process(ctx, in.cmd) // queued
	}
	_, err := pipe.Exec(ctx)
	setPipelineErr(invs, err) // errors are read per command
	for pass := 0; pass < 2; pass++ {
		var retry redis.Pipeliner
		for _, in := range invs {
			if !isNoScript(in.cmd.Err()) {
				continue
			}
			if retry == nil {
				retry = r.client.Pipeline()
				in.cmd = in.command(ctx, "eval", s.srcArg)
			} else if pass == 0 {
				in.cmd = in.command(ctx, "evalsha", s.shaArg)
			} else {
				in.cmd = in.command(ctx, "eval", s.srcArg)
			}
			_ = retry.Process(ctx, in.cmd) // queued
		}
		if retry == nil {
			return
		}
		_, err = retry.Exec(ctx)
		setPipelineErr(invs, err)
	}
}

// command returns in's command: name (EVALSHA or EVAL), then body (the
// script's hash or source), the keys and the arguments, as go-redis's
// EvalSha builds it, whose first key routes it on a Cluster. It is laid
// out in in.line when args still sits in it, after the keys (batchOf
// builds a batch of one call so, unless its arguments outgrew their room),
// for its first command, else in a new one: go-redis's took
// one more allocation, for the hash, every call. A command sent again (by
// EVAL after NOSCRIPT, or resent) gets a line of its own: a go-redis hook
// may keep the first command, whose arguments must not change under it.
// name and body are any so that neither is boxed per call: a constant
// name costs nothing.
func (in *invocation) command(ctx context.Context, name, body any) *redis.Cmd {
	n := 3 + len(in.keys)
	line := in.line
	if !in.lent && len(in.args) > 0 && n+len(in.args) <= len(line) && &line[n] == &in.args[0] {
		line = line[:n+len(in.args)]
	} else {
		line = make([]any, n+len(in.args))
		copy(line[n:], in.args)
	}
	in.lent = true
	line[0], line[1], line[2] = name, body, len(in.keys) // an int, as go-redis's EvalSha (hooks read it)
	for i, k := range in.keys {
		line[3+i] = k
	}
	cmd := redis.NewCmd(ctx, line...)
	if len(in.keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
	return cmd
}

// clientTimedOut reports whether err is a timeout of the client's own (a
// read, write or dial deadline of go-redis's), which says nothing of
// whether Redis ran the call.
func clientTimedOut(err error) bool {
	if err == nil {
		return false // before ne, which escapes: a call that succeeded allocates nothing here
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// atDeadline returns err, a call's error, as ctx's error (wrapping err) if
// the call timed out because ctx ended: go-redis sets ctx's deadline on
// the connection (ContextTimeoutEnabled) and reports a read it cut as the
// socket's "i/o timeout", a net.Error like any other, and callers tell the
// end of their time budget by ctx's error. Regression: a call cut at the
// budget while this process was behind its scheduler was counted as Redis
// failing, without the checks that tell the two apart. ctx has ended once
// its deadline has passed, whether or not its timer has run (see
// deadline.Ended).
func atDeadline(ctx context.Context, err error) error {
	cerr := deadline.Ended(ctx)
	if cerr == nil || !clientTimedOut(err) || errors.Is(err, cerr) {
		return err
	}
	return fmt.Errorf("%w: %w", cerr, err)
}

// setPipelineErr reconciles each command of invs with err, its pipeline's
// error. A command with neither a reply nor an error gets err: go-redis
// leaves them so when the pipeline failed before it was sent (a connection
// whose AUTH was refused), and a command read then looks like an empty
// reply. A command whose reply was read keeps it, error cleared: when a
// connection breaks after Redis answered the first commands of a pipeline,
// go-redis retries the whole pipeline and, once its retries cannot
// reconnect, gives its last error (a refused dial) to every command that
// had none, those answered too. Taken as failed, such an acquire's grant
// was lost (taken from the bucket, never used, and what the failure policy
// admitted in its place charged again) and an adjustment was sent a second
// time. A reply read is Redis's word on the call: go-redis clears a
// command's reply whenever a read of it fails.
func setPipelineErr(invs []*invocation, err error) {
	if err == nil {
		return
	}
	for _, in := range invs {
		switch {
		case in.cmd.Val() != nil:
			in.cmd.SetErr(nil)
		case in.cmd.Err() == nil:
			in.cmd.SetErr(err)
		}
	}
}

// run calls EVALSHA and, when the server has not cached the script (NOSCRIPT:
// after SCRIPT FLUSH, a restart or a failover), EVAL, which caches it again.
func (r *Redis) run(ctx context.Context, s script, key string, args ...any) (any, error) {
	return r.runKeys(ctx, s, []string{key}, args...)
}

// runKeys is run for a script of several keys (of one hash slot). It is
// not sent again (a reset is not safe to resend); a timeout at ctx's
// deadline reports ctx's error (see atDeadline).
func (r *Redis) runKeys(ctx context.Context, s script, keys []string, args ...any) (any, error) {
	in := &invocation{keys: keys, args: args}
	r.sendAll(ctx, s, []*invocation{in}) // once, EVAL after NOSCRIPT
	v, err := in.cmd.Result()
	if err != nil {
		return nil, classify(atDeadline(ctx, err))
	}
	return v, nil
}

// isNoScript reports whether err is Redis's NOSCRIPT. A nil err is looked
// at first: HasErrorPrefix allocates on every call, and nearly every reply
// is not an error.
func isNoScript(err error) bool { return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") }
