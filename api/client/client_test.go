package client

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// fake answers like a server: the paths the tests use, the admin calls
// only with the bearer token "s3cret".
func fake(t *testing.T) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/v1/cluster", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"healthy_prefill":1,"healthy_decode":0,"servers":[` +
			`{"role":"prefill","url":"http://p:1","healthy":true,"tp_size":2,"model":"tiny","last_check":null},` +
			`{"role":"decode","url":"http://d:1","healthy":false,"reason":"2 checks failed","tp_size":1,"model":"tiny","last_check":null}]}`))
	})
	mux.HandleFunc("GET /debug/v1/pd", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("queue") != "transfer" {
			t.Errorf("pd query %q", r.URL.RawQuery)
		}
		w.WriteHeader(http.StatusNotFound)
		w.Write([]byte(`{"error":{"message":"not a PD server","type":"invalid_request_error","param":null,"code":null}}`))
	})
	mux.HandleFunc("GET /debug/v1/settings", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"role":"decode","tp_size":2,"heartbeat_ms":50,"pd":{"transfer_timeout_ms":7000,"abort_ack_timeout_ms":1500},` +
			`"faults_on":["drop-kv-chunk"]}`))
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		w.Write([]byte(`{"status":"unhealthy","reason":"engine failed: boom"}`))
	})
	mux.HandleFunc("GET /debug/v1/steps", func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // answers only once the client has given up
	})
	mux.HandleFunc("POST /admin/v1/rooms/{room}/abort", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer s3cret" {
			w.WriteHeader(http.StatusUnauthorized)
			w.Write([]byte(`{"error":{"message":"admin API: wrong bearer token"}}`))
			return
		}
		w.Write([]byte(`{"aborted":` + r.PathValue("room") + `0}`))
	})
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	return ts
}

func TestClient(t *testing.T) {
	ts := fake(t)
	ctx := context.Background()
	servers, err := Discover(ctx, ts.URL, "", nil)
	if err != nil || len(servers) != 2 || servers[0].URL != "http://p:1" || servers[0].TPSize != 2 ||
		servers[1].Healthy || servers[1].Reason != "2 checks failed" {
		t.Fatalf("Discover: %+v %v", servers, err)
	}

	c := New(ts.URL+"/", "s3cret", nil)
	if a, err := c.AbortRoom(ctx, 7); err != nil || a != (debug.AbortResponse{Aborted: 70}) {
		t.Errorf("AbortRoom with the token: %+v %v", a, err)
	}
	_, err = New(ts.URL, "", nil).AbortRoom(ctx, 7)
	if StatusOf(err) != 401 || err.Error() != ts.URL+"/admin/v1/rooms/7/abort: 401 admin API: wrong bearer token" {
		t.Errorf("AbortRoom without the token: %v", err)
	}
	if _, err := c.PD(ctx, "transfer"); StatusOf(err) != 404 || !strings.HasSuffix(err.Error(), ": 404 not a PD server") {
		t.Errorf("PD on a colocated server: %v", err)
	}
	if st, err := c.Settings(ctx); err != nil || st.Role != "decode" || st.PD == nil || debug.Duration(st.PD.TransferTimeoutMS) != 7*time.Second ||
		debug.Duration(st.PD.AbortAckTimeoutMS) != 1500*time.Millisecond || len(st.FaultsOn) != 1 {
		t.Errorf("Settings: %+v %v", st, err)
	}
	var ae *APIError
	if err := c.Health(ctx); !errors.As(err, &ae) || ae.Status != 503 || ae.Message != "engine failed: boom" {
		t.Errorf("Health: %v", err)
	}
	c.Timeout = 20 * time.Millisecond
	if _, err := c.Steps(ctx); !errors.Is(err, context.DeadlineExceeded) || StatusOf(err) != 0 {
		t.Errorf("Steps past the timeout: %v", err)
	}
}

// TestEachUnreachable: an unreachable server is one result's error; the
// others answer.
func TestEachUnreachable(t *testing.T) {
	ts := fake(t)
	clients := []*Client{New("http://127.0.0.1:1", "", nil), New(ts.URL, "", nil)}
	res := Each(context.Background(), clients, func(ctx context.Context, c *Client) (debug.ClusterResponse, error) {
		return c.Cluster(ctx)
	})
	if len(res) != 2 || res[0].URL != "http://127.0.0.1:1" || !errors.Is(res[0].Err, syscall.ECONNREFUSED) {
		t.Errorf("unreachable: %+v", res[0])
	}
	if res[1].Err != nil || len(res[1].Value.Servers) != 2 {
		t.Errorf("reachable: %+v", res[1])
	}
}

// TestText: the text answers (metrics, stacks) come back as they are; an
// error status is an *APIError, an unreachable server a transport error.
func TestText(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("# TYPE pdkit_up gauge\npdkit_up 1\n"))
	})
	mux.HandleFunc("GET /debug/v1/stacks", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadRequest)
		w.Write([]byte(`{"error":{"message":"rank \"x\" is not a number"}}`))
	})
	ts := httptest.NewServer(mux)
	defer ts.Close()
	ctx := context.Background()
	if m, err := New(ts.URL, "", nil).Metrics(ctx); err != nil || m != "# TYPE pdkit_up gauge\npdkit_up 1\n" {
		t.Errorf("Metrics: %q %v", m, err)
	}
	if _, err := New(ts.URL, "", nil).Stacks(ctx, 3); StatusOf(err) != 400 || !strings.HasSuffix(err.Error(), "/debug/v1/stacks?rank=3: 400 rank \"x\" is not a number") {
		t.Errorf("Stacks: %v", err)
	}
	_, err := New("http://127.0.0.1:1", "", nil).Metrics(ctx)
	if !errors.Is(err, syscall.ECONNREFUSED) || err.Error() != "GET http://127.0.0.1:1/metrics: dial tcp 127.0.0.1:1: connect: connection refused" {
		t.Errorf("Metrics unreachable: %v", err)
	}
}
