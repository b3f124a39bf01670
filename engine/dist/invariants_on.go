//go:build invariants || race

package dist

// invariants turns on self-checks of the rendezvous (a rank enters the open
// round's seq, once). On under -tags invariants and under the race detector,
// off in release builds.
const invariants = true
