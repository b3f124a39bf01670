package router

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/httpx"
)

// The pause as a scripted trace: admission stops and resumes, a second
// pause extends the lease, and a lease that ends resumes by itself.
func TestPauseStateTrace(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	var p pauseState
	steps := []struct {
		name string
		do   func() bool
		want bool
	}{
		{"admitted while open", func() bool { return p.admit(at(0)) }, true},
		{"a pause is new", func() bool { return p.pause(at(1), 10*time.Second) }, true},
		{"not admitted while paused", func() bool { return p.admit(at(2)) }, false},
		{"a second pause extends the first", func() bool { return p.pause(at(5), 10*time.Second) }, false},
		{"still paused past the first lease", func() bool { return p.admit(at(12)) }, false},
		{"admitted once the extended lease ends", func() bool { return p.admit(at(15)) }, true},
		{"a new pause", func() bool { return p.pause(at(20), time.Minute) }, true},
		{"resume ends it", func() bool { return p.resume(at(21)) }, true},
		{"admitted after the resume", func() bool { return p.admit(at(21)) }, true},
		{"resume without a pause", func() bool { return p.resume(at(22)) }, false},
		{"a lease ended is no pause to resume", func() bool { p.pause(at(30), time.Second); return p.resume(at(40)) }, false},
	}
	for _, s := range steps {
		if got := s.do(); got != s.want {
			t.Fatalf("%s: %v, want %v (state %+v)", s.name, got, s.want, p)
		}
	}
	if p.inFlight != 3 {
		t.Errorf("in flight %d, want the 3 admitted", p.inFlight)
	}
}

// The gate in a bubble: a request waits while paused and enters on
// resume; the pause's drain channel closes once what was in flight
// leaves; a client that goes stops waiting; a lease that ends admits.
func TestGate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGate()
		if _, err := g.enter(t.Context()); err != nil {
			t.Fatal(err)
		}
		drained := g.pause(time.Minute)
		entered := make(chan bool, 1)
		go func() {
			waited, err := g.enter(context.Background())
			if err != nil {
				t.Error(err)
			}
			entered <- waited
		}()
		gone, cancel := context.WithCancel(context.Background())
		left := make(chan error, 1)
		go func() {
			_, err := g.enter(gone)
			left <- err
		}()
		synctest.Wait()
		if paused, _, waiting, inFlight := g.status(); !paused || waiting != 2 || inFlight != 1 {
			t.Fatalf("paused %v, %d waiting, %d in flight; want paused, 2, 1", paused, waiting, inFlight)
		}
		select {
		case <-drained:
			t.Fatal("drained with a request in flight")
		case <-entered:
			t.Fatal("a request entered while paused")
		default:
		}
		cancel()
		if err := <-left; err == nil {
			t.Fatal("a client that went still entered")
		}
		g.leave()
		select {
		case <-drained:
		default:
			t.Fatal("not drained once the request in flight left")
		}
		if ok, _, held := g.resume(); !ok || held != 2 {
			t.Fatalf("resume: %v, %d held; want true, 2", ok, held)
		}
		if waited := <-entered; !waited {
			t.Fatal("the request that waited says it did not")
		}
		g.leave()

		// A lease that ends admits by itself.
		select {
		case <-g.pause(time.Minute):
		default:
			t.Fatal("paused with nothing in flight: not drained at once")
		}
		go func() {
			waited, _ := g.enter(context.Background())
			entered <- waited
		}()
		time.Sleep(59 * time.Second) // the bubble's clock: the lease is a minute
		synctest.Wait()
		select {
		case <-entered:
			t.Fatal("entered before the lease ended")
		default:
		}
		time.Sleep(time.Second) // the bubble's clock, to the lease's end
		if waited := <-entered; !waited {
			t.Fatal("the request that waited for the lease says it did not")
		}
		if paused, _, _, _ := g.status(); paused {
			t.Fatal("still paused after the lease")
		}
	})
}

// The router's pause through its admin API: refused without the token; a
// request sent while paused waits, reaching no server, and is served once
// resumed; the debug view and the metrics show the pause.
func TestPauseAdmin(t *testing.T) {
	synctest.Test(t, testPauseAdmin)
}

func testPauseAdmin(t *testing.T) {
	m := newMemNet()
	var calls atomic.Int64
	p := newMemStub(t, m, pdproto.RolePrefill, nil)
	d := newMemStub(t, m, pdproto.RoleDecode, func(s *stub) {
		s.gen = func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
			calls.Add(1)
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"id":"cmpl-1","choices":[{"text":"ok","finish_reason":"length"}]}`))
		}
	})
	c := startMem(t, m, []*stub{p}, []*stub{d}, func(o *Options) { o.Admin = httpx.AdminRule{Token: "sesame"} })
	admin := func(path, token string) (int, string) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.srv.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := c.httpClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, readAll(t, resp)
	}
	if code, body := admin(debug.PausePath, ""); code != http.StatusUnauthorized || !strings.Contains(body, "missing bearer token") {
		t.Fatalf("pause without a token: %d %s", code, body)
	}
	if code, body := admin(debug.PausePath, "guess"); code != http.StatusUnauthorized {
		t.Fatalf("pause with a wrong token: %d %s", code, body)
	}
	for _, q := range []string{"?lease=0s", "?lease=31m", "?drain=-1s", "?lease=soon"} {
		if code, body := admin(debug.PausePath+q, "sesame"); code != http.StatusBadRequest {
			t.Fatalf("pause%s: %d %s", q, code, body)
		}
	}
	code, body := admin(debug.PausePath+"?lease=1m&drain=5s", "sesame")
	var pr debug.PauseResponse
	if code != http.StatusOK || json.Unmarshal([]byte(body), &pr) != nil || !pr.Drained || pr.InFlight != 0 || pr.LeaseMS != 60000 {
		t.Fatalf("pause: %d %s", code, body)
	}
	done := make(chan string, 1)
	go func() {
		resp := c.post(t, context.Background(), "/v1/completions", `{"prompt":"x"}`)
		done <- readAll(t, resp)
	}()
	synctest.Wait()
	if n := calls.Load(); n != 0 {
		t.Fatalf("%d requests reached the decode while paused", n)
	}
	if cr := c.clusterState(t); !cr.Paused || cr.Waiting != 1 {
		t.Fatalf("cluster view while paused: %+v", cr)
	}
	if text := c.metricsText(t); !strings.Contains(text, "pdkit_router_paused 1\n") || !strings.Contains(text, "pdkit_router_paused_waiting_requests 1\n") {
		t.Fatalf("metrics while paused:\n%s", grepLines(text, "paused"))
	}
	code, body = admin(debug.ResumePath, "sesame")
	var rr debug.ResumeResponse
	if code != http.StatusOK || json.Unmarshal([]byte(body), &rr) != nil || !rr.Resumed || rr.Held != 1 {
		t.Fatalf("resume: %d %s", code, body)
	}
	if got := <-done; !strings.Contains(got, `"text":"ok"`) {
		t.Fatalf("the request that waited: %s", got)
	}
	if text := c.metricsText(t); !strings.Contains(text, "pdkit_router_paused 0\n") || !strings.Contains(text, "pdkit_router_paused_waits_total 1\n") {
		t.Fatalf("metrics after the resume:\n%s", grepLines(text, "paused"))
	}
	if code, body = admin(debug.ResumePath, "sesame"); code != http.StatusOK || !strings.Contains(body, `"resumed":false`) {
		t.Fatalf("a second resume: %d %s", code, body)
	}
}

// grepLines returns the lines of text that contain s.
func grepLines(text, s string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
