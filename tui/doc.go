// Package tui is the Bubble Tea application behind "pdctl top": a live view
// of a cluster's servers (and its router) with the requests each failed,
// their index-K precision and host tier (HiCache), and a panel of ranks
// per server: each rank's loop, phase, step and Δ to its group, the
// collective it waits in (named with its communicator) and for how long,
// its step rate over the last samples as a sparkline (History), its
// sequence numbers on the control and the forward communicator, the PD
// queues and KV, a rank that holds or left its tensor-parallel group marked
// and named; the findings of the diag rules over the last few seconds of
// samples beneath. The layout fits the screen by dropping the lesser
// columns first, never those that name a stalled rank; one KeyMap drives
// both the keys and the help line.
//
// The package does not read the cluster itself: the caller's Fetch takes
// one Sample, a diag.Sample (the same reading "pdctl diagnose" and "pdctl
// bundle" take) with each server's host tier beside it, and Frame renders a
// window of them, styled for a terminal or plain. Like the rest of pdctl's
// operator side it reaches the cluster only through package api
// (internal/lint enforces it).
package tui
