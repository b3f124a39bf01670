package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// prefillOnly sends a prefill-only request for room to c's prefill server
// (it waits in the bootstrap queue for a decode that never comes) and
// returns a channel that gets the answer's status once the request ends.
func (c *cluster) prefillOnly(t *testing.T, room uint64) <-chan int {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0,
		"ignore_eos": true, "bootstrap_room": room})
	done := make(chan int, 1)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.prefill.ts.URL+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	return done
}

func waitEnded(t *testing.T, what string, done <-chan int) int {
	t.Helper()
	select {
	case code := <-done:
		return code
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the request did not end within 10s", what)
		return 0
	}
}

func checkRun(t *testing.T, c *cluster, wantCode exitCode, wantOut, wantErr string, args ...string) {
	t.Helper()
	code, out, errOut := c.pdctl(t, false, args...)
	if code != wantCode || out != wantOut || errOut != wantErr {
		t.Fatalf("pdctl %q: exit %d, want %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s\nwant:\n%s", args, code, wantCode, out, wantOut, errOut, wantErr)
	}
}

func TestAbortSynthetic(t *testing.T) {
	c := newCluster(t)

	// One room, one rank: the ack comes back, the request fails on
	// every rank (the ranks agree by MIN) and ends.
	done := c.prefillOnly(t, 7)
	poll(t, "room 7 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 2
	})
	checkRun(t, c, exitOK, "7\t0\tPREFILL-RANK0\tacked\tno\t*\talive\n", "",
		"abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "5s")
	if code := waitEnded(t, "room 7", done); code == http.StatusOK {
		t.Fatalf("room 7 answered %d after its ABORT", code)
	}
	poll(t, "room 7 out of the bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 0
	})

	// Every room of a queue on every rank. The first rank to handle its
	// ABORT fails the room on both ranks (they agree by MIN); the other
	// rank acknowledges its ABORT all the same, for a room it no longer
	// has.
	done = c.prefillOnly(t, 8)
	done9 := c.prefillOnly(t, 9)
	poll(t, "rooms 8 and 9 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 4
	})
	code, out, errOut := c.pdctl(t, false, "abort", "--prefill", c.prefill.ts.URL, "--rooms-from-queue", "bootstrap")
	lines := strings.Split(out, "\n")
	slices.Sort(lines)
	if want := "\n8\t0\tPREFILL-RANK0\tacked\tno\t*\talive\n8\t1\tPREFILL-RANK1\tacked\tno\t*\talive\n" +
		"9\t0\tPREFILL-RANK0\tacked\tno\t*\talive\n9\t1\tPREFILL-RANK1\tacked\tno\t*\talive"; code != exitOK || strings.Join(lines, "\n") != want || errOut != "" {
		t.Fatalf("--rooms-from-queue: exit %d\n%s\nwant (sorted)\n%s\nstderr: %s", code, out, want, errOut)
	}
	waitEnded(t, "room 8", done)
	waitEnded(t, "room 9", done9)
	checkRun(t, c, exitOK, "", "no rooms in queue active on PREFILL\n",
		"abort", "--prefill", c.prefill.ts.URL, "--rooms-from-queue", "active")

	// A room no rank has: every rank acknowledges at once (it writes
	// nothing for a room it does not have). As JSON.
	code, out, errOut = c.pdctl(t, false, "abort", "--prefill", c.prefill.ts.URL, "--room", "12345", "--json")
	out = maskJSON(out, "ack_ms")
	want := `{
  "aborts": [
    {
      "room": 12345,
      "rank": 0,
      "endpoint": "PREFILL-RANK0",
      "result": "acked",
      "in_flight": false,
      "ack_ms": 0,
      "control_loop": "alive"
    },
    {
      "room": 12345,
      "rank": 1,
      "endpoint": "PREFILL-RANK1",
      "result": "acked",
      "in_flight": false,
      "ack_ms": 0,
      "control_loop": "alive"
    }
  ]
}
`
	if code != exitOK || out != want || errOut != "" {
		t.Fatalf("--json: exit %d\n%s\nwant\n%s\nstderr: %s", code, out, want, errOut)
	}

	// Usage errors.
	for _, args := range [][]string{
		{"abort"},
		{"abort", "--prefill", c.prefill.ts.URL},
		{"abort", "--prefill", c.prefill.ts.URL, "--room", "1", "--rooms-from-queue", "bootstrap"},
		{"abort", "--prefill", c.prefill.ts.URL, "--rooms-from-queue", "transfer"},
		{"abort", "--sessions", "2", "--room", "1"},
	} {
		if code, _, _ := c.pdctl(t, false, args...); code != exitUsage {
			t.Errorf("pdctl %q: exit %d, want %d", args, code, exitUsage)
		}
	}
	checkRun(t, c, exitError, "", "pdctl: DECODE is a decode server; ABORTs go to a prefill server\n",
		"abort", "--prefill", c.decode.ts.URL, "--room", "1")
}

func TestAbortDeadLoop(t *testing.T) {
	c := newCluster(t)
	if code, _, errOut := c.pdctl(t, false, "--server", c.prefill.ts.URL, "fault", "on", "bootstrap-abort-crash"); code != exitOK {
		t.Fatalf("fault on: exit %d: %s", code, errOut)
	}
	c.prefillOnly(t, 7)
	poll(t, "room 7 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 2
	})
	checkRun(t, c, exitError,
		"7\t0\tPREFILL-RANK0\tno ack\t-\t-\tdead: control loop: unknown message type ABORT (fault bootstrap-abort-crash): zmqlink: handler ended the receive loop\n",
		"pdctl: 1 ABORT of 1 not acknowledged within 300ms; the control loop of rank 0 of PREFILL is dead\n",
		"abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "300ms")
}

func TestAbortDrill(t *testing.T) {
	c := newCluster(t)
	code, out, errOut := c.pdctl(t, false, "abort", "--sessions", "20", "--max-tokens", "100", "--drain-timeout", "5s")
	want := "PREFILL\tprefill\tbootstrap\t*\tdrained\t*\n" +
		"PREFILL\tprefill\tactive\t*\tdrained\t*\n" +
		"PREFILL\tprefill\tinflight\t*\tdrained\t*\n" +
		"DECODE\tdecode\tprealloc\t*\tdrained\t*\n" +
		"DECODE\tdecode\ttransfer\t*\tdrained\t*\n" +
		"DECODE\tdecode\taborting\t*\tdrained\t*\n" +
		"\n" +
		"3\t3\t-\n"
	if code != exitOK || out != want {
		t.Fatalf("exit %d, want 0\nstdout:\n%s\nwant:\n%s\nstderr:\n%s", code, out, want, errOut)
	}
	if !regexp.MustCompile(`^opened 20 sessions through ROUTER; \d+ streaming, \d+ finished, 0 refused; cancelled after [0-9.]+ms\n$`).MatchString(errOut) {
		t.Fatalf("stderr:\n%s", errOut)
	}

	// The same report as JSON.
	code, out, errOut = c.pdctl(t, false, "abort", "--sessions", "5", "--max-tokens", "100", "--drain-timeout", "5s", "--json")
	var rep drillOutput
	if err := json.Unmarshal([]byte(out), &rep); code != exitOK || err != nil {
		t.Fatalf("--json: exit %d, %v\nstdout:\n%s\nstderr:\n%s", code, err, out, errOut)
	}
	if rep.Sessions != 5 || rep.Streaming+rep.Finished+rep.Refused == 0 || rep.Refused != 0 || rep.DrainTimeoutMS != 5000 ||
		rep.Check != (drillCheckOutput{Sent: 3, Served: 3}) || len(rep.Unreachable) != 0 {
		t.Errorf("report: %+v", rep)
	}
	var queues []string
	for _, q := range rep.Queues {
		queues = append(queues, q.Server+" "+q.Queue)
		if !q.Drained || q.DrainedInMS < 0 || q.DrainedInMS > 5000 {
			t.Errorf("queue %s %s: %+v", q.Server, q.Queue, q)
		}
	}
	if want := []string{"PREFILL bootstrap", "PREFILL active", "PREFILL inflight", "DECODE prealloc", "DECODE transfer", "DECODE aborting"}; !slices.Equal(queues, want) {
		t.Errorf("queues %q, want %q", queues, want)
	}
}
