package server

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// pdHalves are a PD request's two bodies as a router sends them: the
// prefill's without bootstrap_url, the decode's with it.
func pdHalves(prompt []int, room uint64, registry string) (prefill, decode map[string]any) {
	decode = map[string]any{"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
		"bootstrap_room": room, "bootstrap_url": registry}
	prefill = maps(decode)
	delete(prefill, "bootstrap_url")
	return prefill, decode
}

type answer struct {
	r   result
	err error
}

// async sends body to e's completions; the answer comes on the channel.
func async(e *env, body map[string]any) <-chan answer {
	out := make(chan answer, 1)
	go func() {
		r, err := e.completeErr("/v1/completions", body)
		out <- answer{r, err}
	}()
	return out
}

// Two prompts of one length: KV of one fits the other's reserved slots.
var (
	redPrompt = []int{5, 6, 7, 8, 9, 10, 11, 12}
	redOther  = []int{15, 16, 17, 18, 19, 20, 21, 22}
)

// A second request naming a bootstrap room that a live request of the
// server has is refused at once with 409, on the prefill and on the
// decode, and the first request goes on undisturbed to the text it has
// alone.
func TestRedTeamDuplicateRoom(t *testing.T) {
	pe, de, registry := newPDServers(t, serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4})
	pb, db := pdHalves(redPrompt, 1, registry)
	p, d := async(pe, pb), async(de, db)
	alone, pa := <-d, <-p
	if alone.err != nil || pa.err != nil || alone.r.Finish != "length" {
		t.Fatalf("the request alone: decode %+v, prefill %v", alone, pa.err)
	}

	for i, holder := range []*env{pe, de} {
		role := holder.eng.Config().Role
		t.Run("live on the "+role, func(t *testing.T) {
			room := uint64(100 + i)
			pb, db := pdHalves(redPrompt, room, registry)
			dupPB, dupDB := pdHalves(redOther, room, registry)
			first, dupe, rest, restBody := pb, dupPB, de, db
			if holder == de {
				first, dupe, rest, restBody = db, dupDB, pe, pb
			}
			// One half arrives alone and waits for the other.
			firstAnswer := async(holder, first)
			waitfor.For(t, "the room taken", 20*time.Second, func() bool { _, ok := holder.eng.PD().RoomRequest(room); return ok })

			start := time.Now()
			code, body := holder.post(t, "/v1/completions", dupe)
			if code != http.StatusConflict || !strings.Contains(string(body), fmt.Sprintf("bootstrap room %d", room)) || !strings.Contains(string(body), `"param":"bootstrap_room"`) {
				t.Fatalf("a duplicate of a live room on the %s: %d %s, want 409 naming the room", role, code, body)
			}
			if took := time.Since(start); took > 2*time.Second {
				t.Errorf("the refusal took %v", took)
			}

			// The other half comes: the first request ends as it does alone.
			restAnswer := async(rest, restBody)
			decode, prefill := <-firstAnswer, <-restAnswer
			if holder == pe {
				decode, prefill = prefill, decode
			}
			if decode.err != nil || prefill.err != nil || decode.r.Text != alone.r.Text {
				t.Fatalf("the first request after the duplicate: decode %+v (alone %q), prefill %v", decode, alone.r.Text, prefill.err)
			}
		})
	}
	for _, e := range []*env{pe, de} {
		if n := e.eng.PD().RoomsInUse(); n != 1 {
			t.Errorf("%s counted %d duplicate rooms, want 1", e.eng.Config().Role, n)
		}
	}
}

// Halves of two prompts under one room (a client that picks its room, and
// another request's): the prefill's KV is of another prompt than the
// decode's. The fingerprints differ, so the room fails on both sides with
// the reason; the decode never answers 200 with text from the other prompt.
func TestRedTeamCrossWiredHalves(t *testing.T) {
	pe, de, registry := newPDServers(t, serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4})
	pb, _ := pdHalves(redPrompt, 7, registry)
	_, db := pdHalves(redOther, 7, registry)
	p, d := async(pe, pb), async(de, db)
	decode, prefill := <-d, <-p
	if decode.err == nil || !strings.Contains(decode.err.Error(), "prompt") {
		t.Errorf("decode of another prompt's KV: %+v, want an error naming the prompt", decode)
	}
	if prefill.err == nil {
		t.Errorf("prefill whose decode has another prompt: %+v, want an error", prefill)
	}
}

// A decode fetches only its own cluster's prefill registries: a client's
// bootstrap_url pointing anywhere else (a counting server of the test, a
// metadata address, another scheme, the registry with user info or a
// query) is refused with 403 before anything is fetched. A listed registry
// that fails has its own words logged, never answered to the client.
func TestRedTeamBootstrapSSRF(t *testing.T) {
	_, de, registry := newPDServers(t, serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: serve.PDConfig{BootstrapTimeout: 2 * time.Second}})
	const secret = "SECRET-UPSTREAM-TEXT"
	var hits atomic.Int64
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Error(w, secret, http.StatusInternalServerError)
	}))
	t.Cleanup(target.Close)

	urls := []string{target.URL, target.URL + "/bootstrap", "http://169.254.169.254/latest/meta-data/",
		"file:///etc/passwd", "gopher://127.0.0.1:70/", strings.Replace(registry, "http://", "http://user:pw@", 1),
		registry + "?next=" + target.URL, "", "not a url"}
	for i, u := range urls {
		_, db := pdHalves(redPrompt, uint64(300+i), u)
		start := time.Now()
		code, body := de.post(t, "/v1/completions", db)
		switch {
		case u == "" && code == http.StatusBadRequest: // no bootstrap_url at all
		case code != http.StatusForbidden || !strings.Contains(string(body), `"param":"bootstrap_url"`):
			t.Errorf("bootstrap_url %q: %d %s, want 403", u, code, body)
		case strings.Contains(string(body), secret) || (u != "" && strings.Contains(string(body), u)):
			t.Errorf("bootstrap_url %q: the answer reflects it: %s", u, body)
		case time.Since(start) > 2*time.Second:
			t.Errorf("bootstrap_url %q: refused after %v", u, time.Since(start))
		}
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("the decode fetched unlisted URLs %d times", n)
	}
	if n := de.eng.PD().BootstrapRefused(); n != uint64(len(urls)-1) {
		t.Errorf("%d refusals counted, want %d", n, len(urls)-1)
	}

	// Listed, but failing: the client hears that the lookup failed, not
	// what the registry said.
	if err := de.eng.AllowPrefillBootstrap(target.URL); err != nil {
		t.Fatal(err)
	}
	_, db := pdHalves(redPrompt, 400, target.URL)
	code, body := de.post(t, "/v1/completions", db)
	if code == http.StatusOK || !strings.Contains(string(body), "could not be looked up") || strings.Contains(string(body), secret) {
		t.Errorf("a failing listed registry: %d %s, want an error without its text", code, body)
	}
	if hits.Load() == 0 {
		t.Error("the listed registry was never asked")
	}
}
