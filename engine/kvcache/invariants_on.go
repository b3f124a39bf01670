//go:build invariants || race

package kvcache

// invariants turns on the expensive self-checks: every mutating call re-runs
// Check and panics on a broken invariant. On under -tags invariants and under
// the race detector (test and debug builds), off in release builds.
const invariants = true
