package httpx

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestMux(t *testing.T) {
	m := NewMux(slog.New(slog.NewTextHandler(io.Discard, nil)))
	m.Handle("GET", "/ok", func(w http.ResponseWriter, _ *http.Request) { WriteJSON(w, 200, map[string]int{"n": 1}) })
	m.Handle("GET", "/boom", func(http.ResponseWriter, *http.Request) { panic("boom") })
	ts := httptest.NewServer(m)
	defer ts.Close()
	for _, c := range []struct {
		method, path string
		status       int
		body, allow  string
	}{
		{"GET", "/ok", 200, `{"n":1}`, ""},
		{"POST", "/ok", 405, "use GET", "GET"},
		{"GET", "/nope", 404, "no route GET /nope", ""},
		{"GET", "/boom", 500, "internal error", ""},
	} {
		req, _ := http.NewRequest(c.method, ts.URL+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || !strings.Contains(string(b), c.body) || resp.Header.Get("Allow") != c.allow {
			t.Errorf("%s %s: %d %q allow %q", c.method, c.path, resp.StatusCode, b, resp.Header.Get("Allow"))
		}
	}
}
