//go:build !invariants && !race

package rooms

// invariants is off in release builds; see invariants_on.go.
const invariants = false
