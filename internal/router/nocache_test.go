package router

import (
	"context"
	"testing"

	"github.com/pdkit/pdkit/api/pdproto"
)

// The router passes no_cache, a pdkit extension, to both sides of a PD
// request as the client sent it: at the top of an OpenAI body, in
// sampling_params of a /generate one (the cluster test shows the prefill
// obeys it).
func TestNoCacheReachesBothSides(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, nil)
	d := newStub(t, pdproto.RoleDecode, nil)
	c := start(t, []*stub{p}, []*stub{d})
	for _, tc := range []struct{ path, body string }{
		{"/v1/completions", `{"prompt":"hello","max_tokens":4,"no_cache":true}`},
		{"/generate", `{"text":"hello","sampling_params":{"max_new_tokens":4,"no_cache":true}}`},
	} {
		resp := c.post(t, context.Background(), tc.path, tc.body)
		if got := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", tc.path, resp.StatusCode, got)
		}
	}
	p.waitRequests(t, 2)
	for side, bodies := range map[string][]map[string]any{"prefill": p.lastBodies(), "decode": d.lastBodies()} {
		if len(bodies) != 2 {
			t.Fatalf("%s got %d bodies", side, len(bodies))
		}
		for _, b := range bodies {
			v := b["no_cache"]
			if sp, ok := b["sampling_params"].(map[string]any); ok {
				v = sp["no_cache"]
			}
			if v != true {
				t.Errorf("%s body without no_cache: %v", side, b)
			}
		}
	}
}
