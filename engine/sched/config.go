package sched

import (
	"fmt"
	"time"
)

// Config sizes one rank's scheduler. Every rank of a TP group must use the
// same Config.
type Config struct {
	MaxRunning     int // admitted requests (prefilling + decoding) at most
	MaxBatchTokens int // tokens per step, decode and prefill together; at least MaxRunning
	PrefillChunk   int // prompt tokens per request per step (chunked prefill)
	PageSize       int // tokens per KV page
	TotalPages     int // pages in the rank's KV pool

	// Overlap lets Schedule plan the next step while one is in flight,
	// against its predicted outcome (the overlap schedule, see the package
	// doc). Off, Schedule with a step in flight fails with
	// ErrStepInFlight (lock-step).
	Overlap bool

	// Timeouts; zero disables one. WaitingTimeout counts from entering the
	// waiting queue (arrival or retraction), PrefillTimeout from admission
	// until the prompt is fully prefilled, RequestTimeout from arrival over
	// the whole life of a request.
	WaitingTimeout time.Duration
	PrefillTimeout time.Duration
	RequestTimeout time.Duration
}

// Validate rejects impossible configurations.
func (c Config) Validate() error {
	switch {
	case c.MaxRunning < 1:
		return fmt.Errorf("sched: max running %d must be positive", c.MaxRunning)
	case c.MaxBatchTokens < c.MaxRunning:
		return fmt.Errorf("sched: batch tokens %d below max running %d: decode steps could not fit", c.MaxBatchTokens, c.MaxRunning)
	case c.PrefillChunk < 1:
		return fmt.Errorf("sched: prefill chunk %d must be positive", c.PrefillChunk)
	case c.PageSize < 1:
		return fmt.Errorf("sched: page size %d must be positive", c.PageSize)
	case c.TotalPages < 1:
		return fmt.Errorf("sched: total pages %d must be positive", c.TotalPages)
	case c.WaitingTimeout < 0 || c.PrefillTimeout < 0 || c.RequestTimeout < 0:
		return fmt.Errorf("sched: negative timeout")
	}
	return nil
}

// pagesFor is the number of pages that hold n tokens.
func (c Config) pagesFor(n int) int { return (n + c.PageSize - 1) / c.PageSize }
