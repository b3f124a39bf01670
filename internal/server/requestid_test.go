package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// A client's X-Request-Id is echoed and names the request in the debug
// API while it runs; a bad one is refused naming the header.
func TestClientRequestID(t *testing.T) {
	e := newEnv(t)
	b, _ := json.Marshal(map[string]any{"prompt": "once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.ts.URL+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Request-Id", "trace-7")
	resp, err := e.ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if got := resp.Header.Get("X-Request-Id"); resp.StatusCode != 200 || got != "trace-7" {
		t.Fatalf("status %d, X-Request-Id %q", resp.StatusCode, got)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil { // the first token: it runs
		t.Fatal(err)
	}
	waitfor.For(t, "the request in /debug/v1/requests with its client id", 20*time.Second, func() bool {
		var r debug.RequestsResponse
		code, body := get(t, e, "/debug/v1/requests")
		return code == 200 && json.Unmarshal(body, &r) == nil && len(r.Requests) == 1 && r.Requests[0].ClientRequestID == "trace-7"
	})
	cancel()

	code, body := e.send(t, "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 1}, func(r *http.Request, _ []byte) {
		r.Header.Set("X-Request-Id", strings.Repeat("y", 200))
	})
	if code != 400 || !strings.Contains(string(body), `"param":"X-Request-Id"`) {
		t.Fatalf("a 200-byte id: %d %s", code, body)
	}
}
