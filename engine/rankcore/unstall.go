package rankcore

// When nothing runs and the head of the waiting queue does not fit, the
// pages the requests waiting behind it hold locked as their cached
// prefixes may be all that keeps the pool full: without giving some up the
// queue would wait for ever (busy is not dead). The newest waiters give up
// first (they will compute their prefixes), until the head fits. Every rank
// holds the same scheduler and cache, so every rank decides alike.
//
// A prefix that several waiters share frees its pages only when the last
// of them lets go, and other holders (the head, loads in flight) keep
// theirs: what one give-up frees is the cache's to say. So the decision is
// taken a waiter at a time, on the cache's free pages after the one before.

// Waiter is a request in the waiting queue as an unstall sees it.
type Waiter struct {
	ID     uint64
	Locked int  // pages its cached prefix holds locked
	Pinned bool // it holds host pins (a host part waiting to load)
}

// holds reports whether giving w's prefix up changes anything.
func (w Waiter) holds() bool { return w.Locked > 0 || w.Pinned }

// Unstall decides one unstall: which waiters give their cached prefixes
// up, in order. Start it with StartUnstall and call Next until it says
// done; Plan is then the outcome.
type Unstall struct {
	need    int
	waiting []Waiter
	at      int // the next candidate, counting down to 1
	plan    UnstallPlan
}

// UnstallPlan is an unstall's outcome.
type UnstallPlan struct {
	Gave []uint64 // the waiters that gave their prefixes up, newest first
	Fits bool     // the head fits in the free pages once they did
	Free int      // the free pages the last Next saw
}

// StartUnstall starts an unstall for a head that needs need free pages;
// waiting is the queue in order, the head first, which never gives up
// its own prefix (it is the one to admit).
func StartUnstall(need int, waiting []Waiter) *Unstall {
	return &Unstall{need: need, waiting: waiting, at: len(waiting) - 1}
}

// Next is, given the cache's free pages now (after the give-ups so far),
// the next waiter to give its prefix up, newest first, skipping those that
// hold nothing; ok is false once the head fits or no waiter behind it is
// left.
func (u *Unstall) Next(free int) (w Waiter, ok bool) {
	u.plan.Free = free
	u.plan.Fits = free >= u.need
	for ; !u.plan.Fits && u.at > 0; u.at-- {
		if w := u.waiting[u.at]; w.holds() {
			u.at--
			u.plan.Gave = append(u.plan.Gave, w.ID)
			return w, true
		}
	}
	return Waiter{}, false
}

// Plan is the unstall's outcome so far: final once Next said done.
func (u *Unstall) Plan() UnstallPlan { return u.plan }
