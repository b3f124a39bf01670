//go:build !race

package bench

// raceDetector: see hicache_race.go.
const raceDetector = false
