package main

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/client"
)

// hangingTransport answers no request: each waits for its context to end.
type hangingTransport struct{}

func (hangingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	<-r.Context().Done()
	return nil, r.Context().Err()
}

// TestSampleWindowSchedule: diagnose samples at start, then every
// interval until the window has passed, on the clock (a synctest bubble
// runs it on fake time, so the schedule is exact whatever the machine's
// load): a 5s window at 1s takes six samples, at 0s to 5s.
func TestSampleWindowSchedule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		w, err := sampleWindow(context.Background(), probe{}, 5*time.Second, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if len(w.Samples) != 6 {
			t.Fatalf("%d samples, want 6", len(w.Samples))
		}
		for i, s := range w.Samples {
			if got, want := s.Taken.Sub(start), time.Duration(i)*time.Second; got != want {
				t.Errorf("sample %d taken at %v, want %v", i, got, want)
			}
		}
	})
}

// TestSampleWindowSilentServer: a server that answers nothing is
// unreachable in each sample after the bound (2s, the floor), and the
// samples after it start on time, not a bound late: the window ends one
// bound after its last sample; cancelling ends the window with what it
// has.
func TestSampleWindowSilentServer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		silent := &target{URL: "http://silent", Role: "decode", TPSize: 1,
			c: client.New("http://silent", "", &http.Client{Transport: hangingTransport{}})}
		start := time.Now()
		w, err := sampleWindow(context.Background(), probe{targets: []*target{silent}}, 3*time.Second, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		// The samples are taken at 0, 1, 2 and 3s, each waiting out the
		// 2s bound beside the next.
		want := []time.Duration{0, time.Second, 2 * time.Second, 3 * time.Second}
		if len(w.Samples) != len(want) {
			t.Fatalf("%d samples, want %d", len(w.Samples), len(want))
		}
		if took := time.Since(start); took != 5*time.Second {
			t.Errorf("the window ended after %v, want 5s (its last sample at 3s, and the 2s bound)", took)
		}
		for i, s := range w.Samples {
			if got := s.Taken.Sub(start); got != want[i] {
				t.Errorf("sample %d taken at %v, want %v", i, got, want[i])
			}
			if len(s.Servers) != 1 || s.Servers[0].Reachable {
				t.Errorf("sample %d: %+v, want the silent server unreachable", i, s.Servers)
			}
		}

		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(2500*time.Millisecond, cancel)
		w, err = sampleWindow(ctx, probe{}, 10*time.Second, time.Second)
		if !errors.Is(err, context.Canceled) || len(w.Samples) != 3 {
			t.Errorf("cancelled at 2.5s: %d samples, %v; want 3 and the cancellation", len(w.Samples), err)
		}
	})
}
