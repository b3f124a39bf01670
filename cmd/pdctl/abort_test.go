package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/api/zmtp"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// prefillOnly sends a prefill-only request for room to c's prefill server
// (it waits in the bootstrap queue for a decode that never comes) and
// returns a channel that gets the answer's status once the request ends.
func (c *cluster) prefillOnly(t *testing.T, room uint64) <-chan string {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0,
		"ignore_eos": true, "bootstrap_room": room})
	done := make(chan string, 1)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.prefill.ts.URL+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	info, err := client.New(c.prefill.ts.URL, "", nil).Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	c.secret.SignRequest(req, b, time.Now(), info.ID) // as the router does: PD requests to a server with a secret are signed
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- "no answer: " + err.Error()
			return
		}
		defer resp.Body.Close()
		var body struct {
			Choices []struct {
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&body)
		finish := ""
		if len(body.Choices) > 0 {
			finish = body.Choices[0].FinishReason
		}
		done <- fmt.Sprintf("%d %s", resp.StatusCode, finish)
	}()
	return done
}

// waitEnded is how a request ended: its status and finish_reason.
func waitEnded(t *testing.T, what string, done <-chan string) string {
	t.Helper()
	return waitfor.Recv(t, what+": the request's end", 10*time.Second, done)
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

	// One room, one rank: the ack comes back saying the rank had the
	// room, the request fails on every rank (the ranks agree by MIN) and
	// ends.
	done := c.prefillOnly(t, 7)
	waitfor.For(t, "room 7 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 2
	})
	checkRun(t, c, exitOK, "7\t0\tPREFILL-RANK0\tacked\tno\t*\talive\n", "",
		"abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "7", "--wait", "5s")
	// An operator's abort is no failure: the request ends as aborted.
	if end := waitEnded(t, "room 7", done); end != "200 abort" {
		t.Fatalf("room 7 ended %q after its ABORT, want 200 abort", end)
	}
	waitfor.For(t, "room 7 out of the bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 0
	})

	// Every room of a queue on every rank. The first rank to handle its
	// ABORT fails the room on both ranks (they agree by MIN); the other
	// rank acknowledges its ABORT all the same, for a room it may no
	// longer have: then it says so, and pdctl, which saw the room in that
	// rank's queue, reports it already ended. Each room was had by at
	// least one rank.
	done = c.prefillOnly(t, 8)
	done9 := c.prefillOnly(t, 9)
	waitfor.For(t, "rooms 8 and 9 in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 4
	})
	code, out, errOut := c.pdctl(t, false, "abort", "--prefill", c.prefill.ts.URL, "--rooms-from-queue", "bootstrap")
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	slices.Sort(lines)
	line := regexp.MustCompile(`^(8|9)\t([01])\tPREFILL-RANK([01])\t(acked|acked, room already ended)\tno\t\*\talive$`)
	had := map[string]bool{}
	for i, l := range lines {
		m := line.FindStringSubmatch(l)
		if m == nil || m[2] != m[3] || len(lines) != 4 || m[1] != []string{"8", "8", "9", "9"}[i] {
			t.Fatalf("--rooms-from-queue: exit %d, line %q of\n%s\nstderr: %s", code, l, out, errOut)
		}
		had[m[1]] = had[m[1]] || m[4] == "acked"
	}
	if code != exitOK || errOut != "" || !had["8"] || !had["9"] {
		t.Fatalf("--rooms-from-queue: exit %d, rooms had by a rank %v\n%s\nstderr: %s", code, had, out, errOut)
	}
	waitEnded(t, "room 8", done)
	waitEnded(t, "room 9", done9)
	checkRun(t, c, exitOK, "", "no rooms in queue active on PREFILL\n",
		"abort", "--prefill", c.prefill.ts.URL, "--rooms-from-queue", "active")

	// A room no rank has: every rank acknowledges at once (it writes
	// nothing for a room it does not have), saying it did not know the
	// room; nothing was aborted, so the command fails. As JSON: the room a
	// string, as every 64-bit id.
	code, out, errOut = c.pdctl(t, false, "abort", "--prefill", c.prefill.ts.URL, "--room", "18446744073709551615", "--json")
	out = maskJSON(out, "ack_ms")
	want := `{
  "aborts": [
    {
      "room": "18446744073709551615",
      "rank": 0,
      "endpoint": "PREFILL-RANK0",
      "result": "acked, room unknown",
      "known": false,
      "in_flight": false,
      "ack_ms": 0,
      "control_loop": "alive"
    },
    {
      "room": "18446744073709551615",
      "rank": 1,
      "endpoint": "PREFILL-RANK1",
      "result": "acked, room unknown",
      "known": false,
      "in_flight": false,
      "ack_ms": 0,
      "control_loop": "alive"
    }
  ]
}
`
	wantErr := "pdctl: room 18446744073709551615: no rank of PREFILL had it, nothing was aborted (each acknowledged the ABORT of a room it did not know)\n"
	if code != exitError || out != want || errOut != wantErr {
		t.Fatalf("--json: exit %d\n%s\nwant\n%s\nstderr: %s", code, out, want, errOut)
	}
	checkRun(t, c, exitError, "12345\t0\tPREFILL-RANK0\tacked, room unknown\tno\t*\talive\n",
		"pdctl: room 12345: no rank of PREFILL had it, nothing was aborted (each acknowledged the ABORT of a room it did not know)\n",
		"abort", "--prefill", c.prefill.ts.URL, "--rank", "0", "--room", "12345")

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
	waitfor.For(t, "room 7 in the prefill's bootstrap queue", 10*time.Second, func() bool {
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
	if !regexp.MustCompile(`^opened 20 sessions of max_tokens 100 through ROUTER; \d+ streaming, \d+ finished, 0 refused; cancelled after [0-9.]+ms\n$`).MatchString(errOut) {
		t.Fatalf("stderr:\n%s", errOut)
	}

	// The same report as JSON, with the default max_tokens: what the
	// model's context (512 tokens) and the servers' KV pools (32 pages of
	// 4 tokens) leave after the prompt, which the servers accept (no
	// session refused).
	code, out, errOut = c.pdctl(t, false, "abort", "--sessions", "5", "--drain-timeout", "5s", "--json")
	var rep drillOutput
	if err := json.Unmarshal([]byte(out), &rep); code != exitOK || err != nil {
		t.Fatalf("--json: exit %d, %v\nstdout:\n%s\nstderr:\n%s", code, err, out, errOut)
	}
	if want := min(drillMaxDefault, c.m.Config.ContextLen, testConfig.KVTokens) - drillPromptRoom; rep.MaxTokens != want {
		t.Errorf("default max_tokens %d, want %d", rep.MaxTokens, want)
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

// TestAbortDrillRefused: sessions the servers refuse (max_tokens beyond the
// model's context) fail the drill, whatever the queues did: exit 1,
// naming the refusal, never "drained" alone.
func TestAbortDrillRefused(t *testing.T) {
	c := newCluster(t)
	code, out, errOut := c.pdctl(t, false, "abort", "--sessions", "3", "--max-tokens", "100000", "--drain-timeout", "2s", "--check", "1")
	if code != exitError || !strings.Contains(errOut, "0 streaming, 0 finished, 3 refused") ||
		!regexp.MustCompile(`pdctl: the drill failed: 3 of 3 sessions refused \(400 .*max_tokens`).MatchString(errOut) {
		t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitError, out, errOut)
	}
}

// scriptedPrefill is a prefill server's two ranks as pdctl sees them: a
// /debug/v1/pd that lists each rank's control endpoint (and room 5 in each
// rank's bootstrap queue), and behind each endpoint a PULL socket that
// answers every ABORT with an ABORT_ACK whose known says whether the rank
// has the room (rank 0 has room 5, rank 1 nothing). It pins what pdctl
// reports for each answer, whatever the engine's own choices.
func scriptedPrefill(t *testing.T) string {
	t.Helper()
	has := []map[uint64]bool{{5: true}, {}}
	var ranks []debug.PDRank
	for r := range has {
		pull, err := zmtp.Listen("tcp://127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pull.Close() })
		ranks = append(ranks, debug.PDRank{Rank: r, Socket: debug.PDSocket{Endpoint: pull.Endpoint(), Alive: true},
			Counts:  map[string]int{debug.PDQueueBootstrap: 1},
			Entries: []debug.PDEntry{{ID: 1, Room: 5, Queue: debug.PDQueueBootstrap}}})
		go func() {
			for {
				frames, err := pull.Recv(context.Background())
				if err != nil {
					return
				}
				m, err := pdproto.Decode(frames)
				a, ok := m.(*pdproto.Abort)
				if err != nil || !ok {
					t.Errorf("rank %d got %v, %v; want an ABORT", r, m, err)
					continue
				}
				ack, _ := pdproto.Encode(&pdproto.AbortAck{Room: a.Room, Rank: uint32(r), Known: has[r][a.Room]})
				if err := zmtp.Send(context.Background(), a.Endpoint, ack); err != nil {
					t.Errorf("rank %d: sending the ack: %v", r, err)
				}
			}
		}()
	}
	body, _ := json.Marshal(debug.PDResponse{Role: pdproto.RolePrefill, Ranks: ranks})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != debug.PDPath {
			http.NotFound(w, r)
			return
		}
		w.Write(body)
	}))
	t.Cleanup(ts.Close)
	return ts.URL
}

// TestAbortKnown: an ack from a rank that had the room is "acked"; from
// one that had not, "acked, room unknown" (or, for a room pdctl listed in
// that rank's queue, "acked, room already ended"). --room fails when no
// rank had the room; --rooms-from-queue does not fail for a room another
// rank had.
func TestAbortKnown(t *testing.T) {
	url := scriptedPrefill(t)
	pdctl := func(args ...string) (exitCode, string, string) {
		var out, errOut bytes.Buffer
		f := &factory{In: strings.NewReader(""), Out: &out, ErrOut: &errOut, Build: testBuild, maskVolatile: true, Getenv: func(string) string { return "" }}
		code := run(t.Context(), f, append([]string{"abort", "--prefill", url}, args...))
		return code, out.String(), strings.ReplaceAll(errOut.String(), url, "PREFILL")
	}
	sorted := func(s string) string {
		lines := strings.Split(strings.TrimSuffix(s, "\n"), "\n")
		slices.Sort(lines)
		return strings.Join(lines, "\n") + "\n"
	}
	code, out, errOut := pdctl("--room", "5")
	if code != exitOK || errOut != "" || !regexp.MustCompile(`(?m)^5\t0\ttcp://\S+\tacked\tno\t\*\talive$`).MatchString(out) ||
		!regexp.MustCompile(`(?m)^5\t1\ttcp://\S+\tacked, room unknown\tno\t\*\talive$`).MatchString(out) {
		t.Errorf("--room 5: exit %d\n%s\nstderr: %s", code, out, errOut)
	}

	code, out, errOut = pdctl("--room", "6", "--json")
	var rep abortOutput
	if err := json.Unmarshal([]byte(out), &rep); err != nil || len(rep.Aborts) != 2 || code != exitError ||
		errOut != "pdctl: room 6: no rank of PREFILL had it, nothing was aborted (each acknowledged the ABORT of a room it did not know)\n" {
		t.Fatalf("--room 6: exit %d, %v\n%s\nstderr: %s", code, err, out, errOut)
	}
	for _, a := range rep.Aborts {
		if a.Room != 6 || a.Known || a.Result != "acked, room unknown" {
			t.Errorf("--room 6: %+v", a)
		}
	}

	code, out, errOut = pdctl("--rooms-from-queue", "bootstrap")
	got := regexp.MustCompile(`tcp://\S+`).ReplaceAllString(sorted(out), "EP")
	if want := "5\t0\tEP\tacked\tno\t*\talive\n5\t1\tEP\tacked, room already ended\tno\t*\talive\n"; code != exitOK || errOut != "" || got != want {
		t.Errorf("--rooms-from-queue: exit %d\n%s\nwant\n%s\nstderr: %s", code, got, want, errOut)
	}
}
