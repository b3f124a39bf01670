package router

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/pdkit/pdkit/api/pdproto"
)

// A client's X-Request-Id is kept: echoed in the response, passed to both
// servers; the router's own id, the abort capability, comes in
// X-Pdkit-Abort-Id. Without a client id both headers carry the router's.
// An id that could forge a log line is refused before any server sees it.
func TestClientRequestID(t *testing.T) {
	var mu sync.Mutex
	seen := map[string][]string{} // role -> X-Request-Id of each generation request
	record := func(s *stub) {
		inner := s.gen
		s.gen = func(w http.ResponseWriter, r *http.Request, body map[string]any) {
			mu.Lock()
			seen[s.role] = append(seen[s.role], r.Header.Get(RequestIDHeader))
			mu.Unlock()
			if inner != nil {
				inner(w, r, body)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"id":"cmpl-1","choices":[{"text":"ok","finish_reason":"length"}]}`))
		}
	}
	p := newStub(t, pdproto.RolePrefill, record)
	d := newStub(t, pdproto.RoleDecode, record)
	c := start(t, []*stub{p}, []*stub{d})
	send := func(id string) *http.Response {
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, c.srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		if id != "" {
			req.Header.Set(RequestIDHeader, id)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}

	resp := send("trace-42/a:b")
	body := readAll(t, resp)
	abortID := resp.Header.Get(AbortIDHeader)
	if resp.StatusCode != 200 || resp.Header.Get(RequestIDHeader) != "trace-42/a:b" || !strings.HasPrefix(abortID, "router-") {
		t.Fatalf("with a client id: %d %q, %s %q, %s %q", resp.StatusCode, body, RequestIDHeader, resp.Header.Get(RequestIDHeader), AbortIDHeader, abortID)
	}
	resp = send("")
	readAll(t, resp)
	if own := resp.Header.Get(AbortIDHeader); !strings.HasPrefix(own, "router-") || resp.Header.Get(RequestIDHeader) != own {
		t.Fatalf("without a client id: %s %q, %s %q", RequestIDHeader, resp.Header.Get(RequestIDHeader), AbortIDHeader, own)
	}
	p.waitRequests(t, 2) // the prefill half may reach its server after the client's answer
	d.waitRequests(t, 2)
	mu.Lock()
	for _, role := range []string{pdproto.RolePrefill, pdproto.RoleDecode} {
		if got := seen[role]; len(got) != 2 || got[0] != "trace-42/a:b" || got[1] != resp.Header.Get(AbortIDHeader) {
			t.Errorf("the %s server saw the ids %q, want the client's then the router's", role, got)
		}
	}
	mu.Unlock()

	for _, bad := range []string{"two words", "tab\there", strings.Repeat("x", 129), "é"} {
		resp := send(bad)
		body := readAll(t, resp)
		if resp.StatusCode != 400 || !strings.Contains(body, `"param":"X-Request-Id"`) {
			t.Errorf("X-Request-Id %q: %d %s", bad, resp.StatusCode, body)
		}
	}
	if p.count() != 2 || d.count() != 2 {
		t.Errorf("the servers got %d and %d requests, want 2 each (bad ids stay at the router)", p.count(), d.count())
	}
}
