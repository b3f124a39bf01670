package sched

import (
	"errors"
	"time"
)

// State is where a request is in its life.
type State uint8

const (
	Waiting    State = iota // queued, holds no KV (new or retracted)
	Prefilling              // admitted, prompt not fully run
	Running                 // admitted, decoding one token per step
	Aborting                // left every queue while in the step in flight (or predicted to end by length in it); finished at StepDone
	Finished                // gone; reported once in a Finish
)

func (s State) String() string {
	switch s {
	case Waiting:
		return "waiting"
	case Prefilling:
		return "prefilling"
	case Running:
		return "running"
	case Aborting:
		return "aborting"
	case Finished:
		return "finished"
	}
	return "state?"
}

// Reason says why a request finished.
type Reason uint8

const (
	ReasonNone    Reason = iota
	ReasonStop           // end-of-generation or stop token
	ReasonLength         // MaxTokens generated
	ReasonAbort          // Abort
	ReasonTimeout        // a Config timeout expired
	ReasonError          // the loop reported an impossible outcome for it
)

func (r Reason) String() string {
	switch r {
	case ReasonNone:
		return "none"
	case ReasonStop:
		return "stop"
	case ReasonLength:
		return "length"
	case ReasonAbort:
		return "abort"
	case ReasonTimeout:
		return "timeout"
	case ReasonError:
		return "error"
	}
	return "reason?"
}

// Request is an arriving generation request.
type Request struct {
	ID        uint64
	PromptLen int // prompt tokens, at least 1
	MaxTokens int // tokens to generate at most, at least 1
	// Cached is how many leading prompt tokens already have KV on shared
	// pages of a prefix cache (a whole number of pages, less than
	// PromptLen): the first admission starts from there and the request
	// holds only the pages beyond them. A retraction gives the prefix up;
	// the request is then recomputed from position 0.
	Cached int
	// Loaded is how many of the Cached tokens (the last whole pages of
	// them) are not on the device yet: the loop loads them back from a
	// host tier into fresh pages when it first admits the request. Until
	// then, and for the request's life, those pages count as the
	// request's own (they need room in the pool), not as shared.
	Loaded int
	// Transferred is how many leading prompt tokens already have KV in the
	// request's own sequence when it arrives (a PD decode request: the KV
	// came from a prefill server). The request holds their pages from Add
	// on, waits holding them and is admitted from there; a retraction gives
	// them up and recomputes from position 0. Less than PromptLen, and not
	// together with Cached.
	Transferred int
}

// Item is one request's part of a step: run the request's tokens
// [Start, Start+Tokens) (prompt, then generated, counted from 0). Start is
// the number of tokens whose KV the loop holds (its Seq's Len): Start 0
// means a fresh sequence (first admission or re-admission after
// retraction). Pages is what the request holds once the loop has reserved
// room for Tokens more (shared prefix pages not counted). WantLogits: sample
// one token from the last position (final prefill chunk, or decode). Fresh
// marks an admission without a sequence: the loop starts a new one, on the
// request's Cached prefix pages when Cached > 0 (then Start == Cached). A
// request that arrived with Transferred KV is admitted on its sequence
// (Fresh false, Start == Transferred).
type Item struct {
	ID         uint64
	Start      int
	Tokens     int
	WantLogits bool
	Pages      int
	Fresh      bool
	Cached     int
}

// Retract is a preempted request: the loop releases its KV now; the request
// went back to the front of the waiting queue and will be recomputed from
// its prompt plus its Generated tokens, which the loop keeps.
type Retract struct {
	ID        uint64
	Generated int
	Pages     int // pages freed
}

// Finish is a request that left the scheduler, reported exactly once.
// Release says the loop holds a KV sequence for it that it must release now
// (Pages of them); a request finished while waiting holds none.
type Finish struct {
	ID        uint64
	Reason    Reason
	Generated int
	Release   bool
	Pages     int
}

// Plan is what the loop does for one step, in this order: release the
// sequences of Finished (Release set) and Retract, then reserve room for
// every Run item and run them as one forward batch. PagesNeeded is the
// number of pages those reservations allocate, never more than the free
// pages given to Schedule plus what Finished and Retract free.
type Plan struct {
	Run         []Item
	Retract     []Retract
	Finished    []Finish
	PagesNeeded int
}

// Outcome is the loop's report of one Run item of the step.
type Outcome struct {
	ID      uint64
	Emitted int  // tokens sampled: 1 for an item with WantLogits, else 0
	Stop    bool // the sampled token ends the generation
}

var (
	ErrDuplicate    = errors.New("sched: request id already known")
	ErrInvalid      = errors.New("sched: invalid request")
	ErrTooLarge     = errors.New("sched: request can never fit the KV pool")
	ErrUnknown      = errors.New("sched: unknown or finished request")
	ErrStepInFlight = errors.New("sched: a step is in flight")
	ErrNoStep       = errors.New("sched: no step in flight")
	ErrOutcome      = errors.New("sched: bad step outcome")
)

// ReqInfo is one request in a Snapshot.
type ReqInfo struct {
	ID          uint64
	State       State
	Age         time.Duration // since arrival
	InState     time.Duration // since entering State
	PromptLen   int
	MaxTokens   int
	Generated   int // confirmed: a token predicted for the step in flight is not counted
	Fed         int // tokens whose KV is held
	InFlight    int // tokens in the steps in flight or planned ahead
	Pages       int
	Retractions int
	Cached      int // prompt tokens read from shared prefix-cache pages
}

// Snapshot is the scheduler's state as plain values, for a debug API.
type Snapshot struct {
	Now          time.Duration
	Waiting      []ReqInfo // FIFO order
	Prefilling   []ReqInfo // admission order
	Running      []ReqInfo // admission order
	Aborting     []ReqInfo // aborted while in the step in flight, or predicted to end by length in it
	StepInFlight bool
	StepAhead    bool // a step is planned ahead of the one in flight
	HeldPages    int
	TotalPages   int
}
