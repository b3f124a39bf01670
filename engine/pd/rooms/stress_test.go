//go:build stress

package rooms

// Under -tags stress the randomized test runs twenty times as many
// sequences: go test -race -tags stress ./engine/pd/rooms/
func init() { randomSequences = 200_000 }
