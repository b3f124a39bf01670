// Package soak holds the soak test of a whole PD cluster, kept out of
// "make test" by the soak build tag (soak_test.go):
//
//	make soak                      # 10 minutes
//	make soak SOAK_DURATION=2m     # a short run; the windows scale with it
//	go test -tags soak -run TestSoak -v -timeout 30m ./internal/soak/ -args -soak.duration=10m
//
// The duration is -soak.duration, else $PDKIT_SOAK_DURATION, else 10m;
// -soak.sessions (60) and -soak.seed (1) set the load, and -soak.samples
// FILE writes every RSS and goroutine sample for a closer look.
//
// It builds pdserve and pdctl (go build, as make build does), starts the
// cluster of make run (pdserve launch: a router, one prefill and one decode
// server as child processes, the built-in model, default settings, no PD_*
// variable; the router on a free port instead of 8000), and computes the
// reference output of every request case alone, one at a time, greedily.
// Then 60 sessions, arriving over the first 10s, send those cases
// concurrently for the duration (completions and chat, streamed and not,
// prompts sharing prefixes or not, from the seed), while pdctl diagnose
// runs every 30s and every server's RSS and goroutine count is sampled
// every 2s.
//
// It requires: no failed request (an HTTP error, an error event, a stream
// cut before [DONE]), every output (text, finish reason, token count)
// equal to its reference, pdctl diagnose healthy every time (and once more
// after the load), RSS and goroutine counts flat: per process, the mean
// over the last fifth of the run (the last 2 minutes of 10) within 10% of
// the mean over its second fifth (minutes 2 to 4); and launch stopping
// every server on SIGINT. With -v it reports the figures.
//
// The package has no non-test code.
package soak
