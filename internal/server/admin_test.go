package server

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// GET /debug/v1/requests shows a saturated engine's queues; the admin API
// aborts by id (ending the stream with "abort") and then the rest, which
// frees the KV.
func TestAdminAbortAndQueues(t *testing.T) {
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 1}, Options{Loopback: true})
	idA, rdA, closeA := openStream(t, e, map[string]any{"prompt": "a", "max_tokens": 400, "ignore_eos": true})
	defer closeA.Close()
	resB := make(chan streamResult, 1)
	go func() { resB <- e.stream(t, map[string]any{"prompt": "b", "max_tokens": 400, "ignore_eos": true}) }()

	var q debug.RequestsResponse
	waitfor.For(t, "a waiting request", 20*time.Second, func() bool {
		getJSON(t, e, "/debug/v1/requests?queue=waiting", &q)
		return len(q.Requests) == 1
	})
	w := q.Requests[0]
	if q.Queue != "waiting" || w.Queue != "waiting" || w.MaxTokens != 400 || w.PromptTokens < 1 || w.Pages != 0 || w.AgeMS < 0 ||
		q.Counts["waiting"] != 1 || q.Counts["running"]+q.Counts["prefilling"] != 1 || len(q.KV) != 1 || q.KV[0].Total == 0 {
		t.Errorf("waiting: %+v", q)
	}
	getJSON(t, e, "/debug/v1/requests?queue=running", &q)
	if len(q.Requests) != 1 || e.srv.idOf("cmpl-", uint64(q.Requests[0].ID)) != idA || q.Requests[0].Generated < 1 || q.Requests[0].Pages < 1 {
		t.Errorf("running (want %s): %+v", idA, q)
	}
	getJSON(t, e, "/debug/v1/requests", &q)
	if len(q.Requests) != 2 {
		t.Errorf("all queues: %+v", q)
	}
	if code, b := get(t, e, "/debug/v1/requests?queue=done"); code != 400 || !bytes.Contains(b, []byte(`"param":"queue"`)) {
		t.Errorf("unknown queue: %d %s", code, b)
	}

	// The admin API (loopback, no token) aborts A by id, then the rest.
	code, b := e.post(t, "/admin/v1/requests/"+idA+"/abort", "")
	var ab debug.AbortResponse
	if code != 200 || json.Unmarshal(b, &ab) != nil || e.srv.idOf("cmpl-", uint64(ab.Aborted)) != idA {
		t.Fatalf("abort %s: %d %s", idA, code, b)
	}
	if r := readStream(t, rdA); r.finish != openai.FinishAbort || !r.done {
		t.Errorf("A after abort: %+v", r)
	}
	waitfor.For(t, "A gone from the snapshot", 20*time.Second, func() bool {
		getJSON(t, e, "/debug/v1/requests", &q)
		return len(q.Requests) == 1
	})
	code, b = e.post(t, "/admin/v1/abort_all", "")
	var all debug.AbortAllResponse
	if code != 200 || json.Unmarshal(b, &all) != nil || len(all.Aborted) != 1 || "cmpl-"+all.Aborted[0].String() == idA {
		t.Fatalf("abort_all: %d %s", code, b)
	}
	select {
	case r := <-resB:
		if r.finish != openai.FinishAbort || !r.done {
			t.Errorf("B after abort_all: %+v", r)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("B did not finish after abort_all")
	}
	waitIdle(t, e.eng)
	getJSON(t, e, "/debug/v1/requests", &q)
	if len(q.Requests) != 0 || q.HeldPages != 0 || q.KV[0].Used != q.KV[0].Cached {
		t.Errorf("after the aborts: %+v", q)
	}
	// Gone now: 404; not an id: 400.
	if code, b := e.post(t, "/admin/v1/requests/"+idA+"/abort", ""); code != 404 {
		t.Errorf("abort of a finished request: %d %s", code, b)
	}
	if code, b := e.post(t, "/admin/v1/requests/x/abort", ""); code != 400 {
		t.Errorf("abort of x: %d %s", code, b)
	}
}

// The admin rule: a token, when set, is always required; without one only
// a loopback server takes admin calls.
func TestAdminAuth(t *testing.T) {
	e := newEnv(t)
	call := func(opts Options, method, path, auth string) (int, openai.ErrorBody, http.Header) {
		t.Helper()
		opts.Logger = slog.New(slog.DiscardHandler)
		srv := New(e.eng, e.m, opts)
		req := httptest.NewRequest(method, path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, req)
		var body openai.ErrorBody
		if rec.Code != 200 {
			if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || body.Error.Message == "" {
				t.Errorf("%s %s: not an error body: %d %s", method, path, rec.Code, rec.Body)
			}
		}
		return rec.Code, body, rec.Header()
	}
	tok := Options{AdminToken: "s3cret"}
	tokLoop := Options{AdminToken: "s3cret", Loopback: true}
	// TestRedTeamAdminOnASecretCluster: a launch cluster has a secret and
	// listens on loopback; another user of the host must not reach its
	// admin API (switch faults, abort everything) without the secret.
	secret, _ := clusterauth.Generate()
	derived := "Bearer " + secret.AdminToken()
	_, kvPassword := secret.KVCredential(time.Now())
	secLoop := Options{ClusterSecret: secret, Loopback: true}
	secTok := Options{ClusterSecret: secret, AdminToken: "s3cret", Loopback: true}
	for _, c := range []struct {
		name       string
		opts       Options
		method     string
		path, auth string
		want       int
		msg        string
	}{
		{"token, none given", tok, "POST", "/admin/v1/abort_all", "", 401, "missing bearer token"},
		{"token, wrong", tok, "POST", "/admin/v1/abort_all", "Bearer s3cre", 401, "wrong bearer token"},
		{"token, wrong scheme", tok, "POST", "/admin/v1/abort_all", "Basic s3cret", 401, "missing bearer token"},
		{"token, loopback, none given", tokLoop, "POST", "/admin/v1/abort_all", "", 401, "missing bearer token"},
		{"token, right", tok, "POST", "/admin/v1/abort_all", "Bearer s3cret", 200, ""},
		{"token, right, any path checked first", tok, "POST", "/admin/v1/nothing", "", 401, "missing bearer token"},
		{"token, right, unknown path", tok, "POST", "/admin/v1/nothing", "Bearer s3cret", 404, "no route"},
		{"token, right, wrong method", tok, "GET", "/admin/v1/abort_all", "Bearer s3cret", 405, "use POST"},
		{"no token, not loopback", Options{}, "POST", "/admin/v1/abort_all", "", 403, "admin API disabled: set --admin-token"},
		{"no token, not loopback, token sent", Options{}, "POST", "/admin/v1/abort_all", "Bearer s3cret", 403, "admin API disabled"},
		{"no token, loopback", Options{Loopback: true}, "POST", "/admin/v1/abort_all", "", 200, ""},
		{"no token, loopback, unknown id", Options{Loopback: true}, "POST", "/admin/v1/requests/cmpl-12345/abort", "", 404, "not known"},
		// TestRedTeamServerAbort: /abort_request takes sequential ids, so
		// it is under the admin rule too.
		{"abort_request, token, none given", tok, "POST", "/abort_request", "", 401, "missing bearer token"},
		{"abort_request, no token, not loopback", Options{}, "POST", "/abort_request", "", 403, "admin API disabled"},
		{"secret, loopback, none given", secLoop, "POST", "/admin/v1/abort_all", "", 401, "missing bearer token (Authorization: Bearer <token>); this server takes the token its cluster secret derives, which pdctl sends given the secret"},
		{"secret, loopback, fault switch, none given", secLoop, "POST", "/admin/v1/faults/stall-last-rank/on", "", 401, "missing bearer token"},
		{"secret, loopback, a KV socket password", secLoop, "POST", "/admin/v1/abort_all", "Bearer " + kvPassword, 401, "wrong bearer token"},
		{"secret, loopback, derived token", secLoop, "POST", "/admin/v1/abort_all", derived, 200, ""},
		{"secret, not loopback, derived token", Options{ClusterSecret: secret}, "POST", "/admin/v1/abort_all", derived, 200, ""},
		{"secret, abort_request, none given", secLoop, "POST", "/abort_request", "", 401, "missing bearer token"},
		{"secret and token, derived token", secTok, "POST", "/admin/v1/abort_all", derived, 401, "wrong bearer token"},
		{"secret and token, the token", secTok, "POST", "/admin/v1/abort_all", "Bearer s3cret", 200, ""},
	} {
		code, body, h := call(c.opts, c.method, c.path, c.auth)
		if code != c.want || !strings.Contains(body.Error.Message, c.msg) {
			t.Errorf("%s: %d %+v, want %d %q", c.name, code, body.Error, c.want, c.msg)
		}
		if code == 401 && !strings.HasPrefix(h.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("%s: WWW-Authenticate %q", c.name, h.Get("WWW-Authenticate"))
		}
	}
	// Over real HTTP too: a token-protected server, a stream aborted by id.
	p := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 8}, Options{AdminToken: "s3cret"})
	id, rd, closer := openStream(t, p, map[string]any{"prompt": prompt, "max_tokens": 400, "ignore_eos": true})
	defer closer.Close()
	if code, b := p.post(t, "/admin/v1/requests/"+id+"/abort", ""); code != 401 {
		t.Errorf("without the token: %d %s", code, b)
	}
	req, _ := http.NewRequest("POST", p.ts.URL+"/admin/v1/requests/"+id+"/abort", nil)
	req.Header.Set("Authorization", "Bearer s3cret")
	resp, err := p.ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("with the token: %d", resp.StatusCode)
	}
	if r := readStream(t, rd); r.finish != openai.FinishAbort || !r.done {
		t.Errorf("after abort: %+v", r)
	}
	waitIdle(t, p.eng)
}
