package server

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/engine/serve"
)

// postSigned posts body to e's path, signed at now with secret (unsigned
// when secret is nil); sign, when set, is the body the signature is made
// over (another body than the one sent: a tampered request).
func postSigned(t *testing.T, e *env, path string, body any, secret *clusterauth.Secret, now time.Time, sign []byte) (int, []byte) {
	t.Helper()
	return e.send(t, path, body, func(req *http.Request, b []byte) {
		if sign == nil {
			sign = b
		}
		secret.SignRequest(req, sign, now, e.srv.id)
	})
}

// A stranger who reaches a PD server's HTTP port sends it PD requests
// directly: unpaired halves that would hold a decode slot and KV pages (a
// prefill's bootstrap entry) until the timeouts, and fail against the
// server's readiness. With a cluster secret, a PD request on any of the
// three generation endpoints must be signed with it: unsigned, signed
// with another secret, stale, or signed over another body, it is refused
// at once with 401 naming bootstrap_room, counted, and nothing of it
// reaches the engine. The router's signed halves are served.
func TestRedTeamUnsignedPD(t *testing.T) {
	secret, _ := clusterauth.Generate()
	other, _ := clusterauth.Generate()
	pe, de, registry := newPDServers(t, serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: serve.PDConfig{Secret: secret, BootstrapTimeout: 2 * time.Second, TransferTimeout: 2 * time.Second}})

	now := time.Now()
	attacks := []struct {
		name   string
		secret *clusterauth.Secret
		at     time.Time
		body   []byte // signed over instead of the sent body
	}{
		{"unsigned", nil, now, nil},
		{"another secret", other, now, nil},
		{"stale", secret, now.Add(-2 * clusterauth.MaxSkew), nil},
		{"from the future", secret, now.Add(2 * clusterauth.MaxSkew), nil},
		{"another body", secret, now, []byte(`{"prompt":[1],"bootstrap_room":1}`)},
	}
	bodies := func(path string, room uint64, decode bool) any {
		b := map[string]any{"max_tokens": 6, "temperature": 0, "ignore_eos": true, "bootstrap_room": room}
		switch path {
		case "/v1/chat/completions":
			b["messages"] = []map[string]any{{"role": "user", "content": "hello"}}
		case "/generate":
			b = map[string]any{"text": "hello", "sampling_params": map[string]any{"max_new_tokens": 6, "temperature": 0}, "bootstrap_room": room}
		default:
			b["prompt"] = redPrompt
		}
		if decode {
			b["bootstrap_url"] = registry
		}
		return b
	}
	room := uint64(500)
	refused := 0
	for _, e := range []*env{pe, de} {
		role := e.eng.Config().Role
		for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/generate"} {
			for _, a := range attacks {
				room++
				start := time.Now()
				code, body := postSigned(t, e, path, bodies(path, room, e == de), a.secret, a.at, a.body)
				took := time.Since(start)
				if code != http.StatusUnauthorized || !strings.Contains(string(body), `"param":"bootstrap_room"`) || !strings.Contains(string(body), "cluster secret") {
					t.Errorf("%s %s, %s: %d %s, want 401 naming bootstrap_room and the cluster secret", role, path, a.name, code, body)
				}
				if took > time.Second {
					t.Errorf("%s %s, %s: refused after %v", role, path, a.name, took)
				}
			}
		}
		refused = 3 * len(attacks)
		if got := scrape(t, e).must(t, `pdkit_pd_refused_reqs_total{reason="unsigned"}`); got != float64(refused) {
			t.Errorf("%s counted %v unsigned PD requests, want %d", role, got, refused)
		}
		// Nothing reached the engine: no request admitted or finished, no
		// room taken, no PD queue entry, readiness untouched.
		s := e.eng.View().Snapshot()
		if s.Totals.Finished != 0 || s.Totals.PromptTokens != 0 {
			t.Errorf("%s engine saw the refused requests: %+v", role, s.Totals)
		}
		if h := e.eng.View().Health(time.Now()); h.Running+h.Waiting+h.Pending != 0 {
			t.Errorf("%s engine holds requests: %+v", role, h)
		}
		for r, entries := range e.eng.PD().QueueEntries() {
			if len(entries) != 0 {
				t.Errorf("%s rank %d PD queues: %+v", role, r, entries)
			}
		}
		if code, body := get(t, e, "/readyz"); code != http.StatusOK {
			t.Errorf("%s /readyz after the refusals: %d %s", role, code, body)
		}
	}

	// The router's halves, signed with the secret, are served end to end,
	// on each endpoint.
	for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/generate"} {
		room++
		type answer struct {
			code int
			body []byte
		}
		pch := make(chan answer, 1)
		go func() {
			code, body := postSigned(t, pe, path, bodies(path, room, false), secret, time.Now(), nil)
			pch <- answer{code, body}
		}()
		dcode, dbody := postSigned(t, de, path, bodies(path, room, true), secret, time.Now(), nil)
		p := <-pch
		if dcode != http.StatusOK || p.code != http.StatusOK {
			t.Errorf("signed %s: decode %d %s, prefill %d %s, want 200 both", path, dcode, dbody, p.code, p.body)
		}
	}
	for _, e := range []*env{pe, de} {
		if got := scrape(t, e).must(t, `pdkit_pd_refused_reqs_total{reason="unsigned"}`); got != float64(refused) {
			t.Errorf("%s counted %v unsigned PD requests after the signed ones, want %d", e.eng.Config().Role, got, refused)
		}
	}
}

// A server with a cluster secret serves requests without PD fields as
// before: only PD requests need the router's signature.
func TestUnsignedColocatedServed(t *testing.T) {
	secret, _ := clusterauth.Generate()
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 4}, Options{ClusterSecret: secret})
	for _, c := range []struct {
		path string
		body any
	}{
		{"/v1/completions", map[string]any{"prompt": redPrompt, "max_tokens": 4}},
		{"/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}}, "max_tokens": 4}},
		{"/generate", map[string]any{"text": "hi", "sampling_params": map[string]any{"max_new_tokens": 4}}},
	} {
		if code, body := postSigned(t, e, c.path, c.body, nil, time.Now(), nil); code != http.StatusOK {
			t.Errorf("%s without PD fields on a server with a secret: %d %s", c.path, code, body)
		}
	}
	// A body over the limit is still 413, not a signature question.
	big := map[string]any{"prompt": strings.Repeat("x", 5<<20), "bootstrap_room": 1}
	if code, body := postSigned(t, e, "/v1/completions", big, nil, time.Now(), nil); code != http.StatusRequestEntityTooLarge {
		t.Errorf("an oversized body: %d %s, want 413", code, body)
	}
}
