//go:build race

package bench

// raceDetector: this binary runs under the race detector, where the
// hicache-indexk-ungated fault (a data race between the loader and the
// forward pass, by design) must not run.
const raceDetector = true
