package serve

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/engine/sched"
)

// ending is how a request ends, whatever ended it: the scheduler (its
// finish), the PD machine (its typed outcome), an admission refused, a
// transfer that arrived complete. Every way out of the engine goes through
// rankLoop.end with one.
type ending struct {
	reason sched.Reason // stop, length, abort, timeout or error
	err    string       // with ReasonError: why
	// pd marks the end of a PD request outside the scheduler: an abort
	// the client asked for names the finish even when the PD side ended
	// it some other way first.
	pd bool
}

// endingOf is the ending of a scheduler finish; releaseErr, when set, is
// why the request's KV could not be given back.
func endingOf(f sched.Finish, releaseErr error) ending {
	en := ending{reason: f.Reason}
	if releaseErr != nil {
		en = ending{reason: sched.ReasonError, err: releaseErr.Error()}
	}
	return en
}

// exits is how requests leave a rank, whatever ends them: the
// scheduler's finishes, aborts, the PD machine's outcomes, the shutdown.
// Each goes through the core, which forgets the request alike on every
// rank, the prefix executor, which gives back what the request held, and,
// on rank 0, the request's stream, which gets its Finish.
type exits struct {
	r       int
	core    *rankcore.Core
	px      *rankPrefix
	pd      *rankPD       // nil on a colocated server
	streams *streams      // rank 0's; nil on the other ranks
	lp      func() pdLoop // the loop as the PD executor sees it
	logger  *slog.Logger
	name    string
}

// end ends request id. Every rank calls it at the same point of the same
// iteration; rank 0, which streams, delivers the Finish.
func (x *exits) end(id uint64, en ending) {
	for _, s := range x.core.End(id) { // a parent before its first token: its samples end with it
		x.end(s, en)
	}
	if x.streams == nil {
		return
	}
	st := x.streams
	r := st.front[id]
	if r == nil {
		return
	}
	delete(st.front, id)
	var reason string
	switch en.reason {
	case sched.ReasonStop:
		reason = ReasonStop
	case sched.ReasonLength:
		reason = ReasonLength
	case sched.ReasonTimeout:
		reason = ReasonTimeout
	default:
		reason = "error: " + en.err
		if en.err == "" {
			reason = "error: " + en.reason.String()
		}
	}
	if en.reason == sched.ReasonAbort || (en.pd && r.cut != "") {
		reason = ReasonAbort
		if r.cut != "" {
			reason = r.cut // the abort's own reason (a client, a slow reader)
		}
		st.totals.Aborts++
	}
	st.totals.Finished++
	st.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
}

// finish ends requests the scheduler finished: each exactly once, with its
// sequence (if any) given to the prefix cache; a PD prefill request goes on
// in the PD machine (it waits for the decode's word) or ends by it.
func (x *exits) finish(fs []sched.Finish) error {
	for _, f := range fs {
		s, err := x.core.Forget(f.ID)
		if err != nil {
			return fmt.Errorf("serve: rank %d: %w", x.r, err)
		}
		err = x.px.forget(f.ID, s.Tokens, f.Release)
		handled, perr := x.pd.schedFinished(x.lp(), f)
		if !handled {
			x.end(f.ID, endingOf(f, err))
		}
		if err != nil {
			return fmt.Errorf("serve: rank %d: release %d: %w", x.r, f.ID, err)
		}
		if perr != nil {
			return perr
		}
	}
	return nil
}

// cut aborts a request the ranks know in whatever state it is; an unknown
// (already finished) or already cut id changes nothing. why, who asked,
// goes with a PD request's abort to its peer.
func (x *exits) cut(id uint64, why string) error {
	c, err := x.core.Cut(id)
	switch {
	case err != nil:
		return fmt.Errorf("serve: rank %d: %w", x.r, err)
	case c.Unknown:
		_, err := x.pd.abort(x.lp(), id, why)
		return err
	case c.InStep && x.streams != nil:
		x.streams.totals.AbortsInStep++
	}
	return x.finish(c.Finishes)
}

// drop forgets every request after the loop stopped; with release set (the
// loops stopped between steps) their sequences and locks are given back, so
// the pool's accounting still balances. A release that fails is logged:
// the engine is shutting down and has nobody else to tell.
func (x *exits) drop(release bool) {
	release = release && !x.core.InFlight()
	for _, id := range x.core.IDs() {
		if !release {
			delete(x.px.holds, id)
			continue
		}
		c, err := x.core.Cut(id)
		for _, f := range c.Finishes {
			s, ferr := x.core.Forget(f.ID)
			if err = errors.Join(err, ferr); ferr == nil {
				err = errors.Join(err, x.px.forget(f.ID, s.Tokens, f.Release))
			}
		}
		delete(x.px.holds, id)
		if err != nil {
			x.logger.Warn("serve: request not released at shutdown", "server", x.name, "rank", x.r, "request", id, "err", err)
		}
	}
}
