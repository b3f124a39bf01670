package serve

import "github.com/pdkit/pdkit/engine/sched"

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

// end ends request id. Every rank calls it at the same point of the same
// iteration; rank 0, which streams, delivers the Finish.
func (l *rankLoop) end(id uint64, en ending) {
	for _, s := range l.forks.Drop(id) { // a parent before its first token: its samples end with it
		l.end(s, en)
	}
	l.finished++
	if l.r != 0 {
		return
	}
	e := l.e
	r := e.streams.front[id]
	if r == nil {
		return
	}
	delete(e.streams.front, id)
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
		e.streams.totals.Aborts++
	}
	e.streams.totals.Finished++
	e.streams.deliver(r, Finish{Reason: reason, PromptTokens: len(r.req.Prompt), CompletionTokens: r.gen})
}
