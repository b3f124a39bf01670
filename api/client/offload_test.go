package client

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
)

// OffloadHiCache posts its prompt as JSON with the token; a 409 is an
// *APIError with the server's message.
func TestOffloadHiCache(t *testing.T) {
	var got []string
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type")+" "+r.Header.Get("Authorization")+" "+string(b))
		if len(got) == 2 {
			w.WriteHeader(http.StatusConflict)
			w.Write([]byte(`{"error":{"message":"hicache is off on this server"}}`))
			return
		}
		w.Write([]byte(`{"prompt_tokens":40,"offloaded_tokens":36}`))
	}))
	defer ts.Close()
	c := New(ts.URL, "s3cret", nil)
	r, err := c.OffloadHiCache(context.Background(), debug.HiCacheOffloadRequest{Prompt: "once upon a time"})
	if err != nil || r.PromptTokens != 40 || r.OffloadedTokens != 36 {
		t.Errorf("offload: %+v %v", r, err)
	}
	_, err = c.OffloadHiCache(context.Background(), debug.HiCacheOffloadRequest{Tokens: []int32{1, 2}})
	if StatusOf(err) != http.StatusConflict || err.Error() != ts.URL+"/admin/v1/hicache/offload: 409 hicache is off on this server" {
		t.Errorf("offload while off: %v", err)
	}
	want := []string{
		`POST /admin/v1/hicache/offload application/json Bearer s3cret {"prompt":"once upon a time"}`,
		`POST /admin/v1/hicache/offload application/json Bearer s3cret {"tokens":[1,2]}`,
	}
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			t.Errorf("call %d: %q, want %q", i, got, want[i])
		}
	}
}
