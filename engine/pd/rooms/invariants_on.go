//go:build invariants || race

package rooms

// invariants turns on the self-checks: every event re-runs Check and panics
// on a broken invariant. On under -tags invariants and under the race
// detector (test and debug builds), off in release builds.
const invariants = true
