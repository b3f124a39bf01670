//go:build stress

// The stress variant of the mass-abort drill, tagged out of the default
// suite (and of make test) for its time. Run it with
//
//	go test -tags stress -run Stress ./internal/...
package router_test

import (
	"testing"
	"time"
)

// 500 streaming sessions through the router, each dropped by its client at
// a seeded random phase; within 2s both servers hold no PD queue entry and
// no KV page, and 20 new requests complete.
func TestClusterStressMassAbortDrill(t *testing.T) {
	// 500 sessions queue far longer than the interactive PD timeouts
	// allow (the prefill fails a request the decode has not preallocated
	// within BootstrapTimeout): the timeouts are raised so that every
	// session ends by its client, which is what the drill is about.
	cfg := drillConfig(2)
	cfg.KVTokens, cfg.MaxRunning = 8192, 16
	cfg.PD.BootstrapTimeout, cfg.PD.TransferTimeout = time.Minute, time.Minute
	massAbortDrill(t, cfg, 89, 500)
}
