package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// End-to-end tests over real HTTP with the tiny built-in model: the engine
// configuration (TP, KV pool size, prefix cache) must never change a greedy
// output, and clients that go away must leave nothing behind.

var tinySpec = builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32}

// newEnvCfg is newEnv with an engine configuration of the caller's.
func newEnvCfg(t *testing.T, cfg serve.Config) *env {
	t.Helper()
	return newEnvModel(t, testmodel.Open(t, tinySpec), cfg)
}

// result is one completion as the tests compare them.
type result struct {
	Text   string
	Finish string
	Usage  openai.Usage
}

// open sends body as JSON to path with a 30 s deadline; cancel ends the
// request once its body is read.
func (e *env) open(path string, body map[string]any) (*http.Response, context.CancelFunc, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	req, err := http.NewRequestWithContext(ctx, "POST", e.ts.URL+path, bytes.NewReader(b))
	if err == nil {
		var resp *http.Response
		if resp, err = e.ts.Client().Do(req); err == nil {
			return resp, cancel, nil
		}
	}
	cancel()
	return nil, nil, err
}

// completeErr posts a non-streamed completion; it may run on any goroutine.
func (e *env) completeErr(path string, body map[string]any) (result, error) {
	resp, cancel, err := e.open(path, body)
	if err != nil {
		return result{}, err
	}
	defer cancel()
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{}, err
	}
	if resp.StatusCode != 200 {
		return result{}, fmt.Errorf("status %d: %s", resp.StatusCode, out)
	}
	if path == "/v1/chat/completions" {
		var r openai.ChatCompletionResponse
		if err := json.Unmarshal(out, &r); err != nil || len(r.Choices) != 1 {
			return result{}, fmt.Errorf("bad chat response %v: %s", err, out)
		}
		return result{r.Choices[0].Message.Content, r.Choices[0].FinishReason, r.Usage}, nil
	}
	var r openai.CompletionResponse
	if err := json.Unmarshal(out, &r); err != nil || len(r.Choices) != 1 {
		return result{}, fmt.Errorf("bad response %v: %s", err, out)
	}
	return result{r.Choices[0].Text, r.Choices[0].FinishReason, r.Usage}, nil
}

// streamErr posts a streamed completion (with include_usage) and puts it
// together; it may run on any goroutine.
func (e *env) streamErr(path string, body map[string]any) (result, error) {
	body = maps(body)
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	resp, cancel, err := e.open(path, body)
	if err != nil {
		return result{}, err
	}
	defer cancel()
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		out, _ := io.ReadAll(resp.Body)
		return result{}, fmt.Errorf("status %d: %s", resp.StatusCode, out)
	}
	var res result
	done, gotUsage := false, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			return res, fmt.Errorf("bad SSE line %q", line)
		}
		if done {
			return res, fmt.Errorf("event after [DONE]: %s", data)
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		if path == "/v1/chat/completions" {
			var c openai.ChatCompletionChunk
			if err := json.Unmarshal([]byte(data), &c); err != nil {
				return res, fmt.Errorf("%v: %s", err, data)
			}
			if c.Usage != nil {
				res.Usage, gotUsage = *c.Usage, true
			}
			for _, ch := range c.Choices {
				res.Text += ch.Delta.Content
				if ch.FinishReason != nil {
					res.Finish = *ch.FinishReason
				}
			}
			continue
		}
		var c openai.CompletionChunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return res, fmt.Errorf("%v: %s", err, data)
		}
		if c.Usage != nil {
			res.Usage, gotUsage = *c.Usage, true
		}
		for _, ch := range c.Choices {
			res.Text += ch.Text
			if ch.FinishReason != nil {
				res.Finish = *ch.FinishReason
			}
		}
	}
	if err := sc.Err(); err != nil {
		return res, err
	}
	if !done || !gotUsage || res.Finish == "" {
		return res, fmt.Errorf("stream incomplete: done %v, usage %v, finish %q", done, gotUsage, res.Finish)
	}
	return res, nil
}

func maps(m map[string]any) map[string]any {
	out := make(map[string]any, len(m)+2)
	for k, v := range m {
		out[k] = v
	}
	return out
}

// runAll serves bodies concurrently, each both streamed and not, and
// returns the non-streamed results after checking that the streamed ones
// agree with them.
func runAll(t *testing.T, e *env, path string, bodies []map[string]any) []result {
	t.Helper()
	plain := make([]result, len(bodies))
	streamed := make([]result, len(bodies))
	var wg sync.WaitGroup
	for i, b := range bodies {
		wg.Go(func() {
			r, err := e.completeErr(path, b)
			if err != nil {
				t.Errorf("request %d: %v", i, err)
			}
			plain[i] = r
		})
		wg.Go(func() {
			r, err := e.streamErr(path, b)
			if err != nil {
				t.Errorf("streamed request %d: %v", i, err)
			}
			streamed[i] = r
		})
	}
	wg.Wait()
	for i := range bodies {
		if plain[i] != streamed[i] {
			t.Errorf("request %d: streamed %+v, not streamed %+v", i, streamed[i], plain[i])
		}
	}
	return plain
}

// checkSame fails on every result of got that differs from want.
func checkSame(t *testing.T, what string, got, want []result) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d results, want %d", what, len(got), len(want))
		return
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("%s: request %d: got %+v, want %+v", what, i, got[i], want[i])
		}
	}
}

// waitPoolsFree waits until the engine is idle and every rank's KV pool
// holds no page but the prefix cache's, all of them evictable: pages in
// use minus cached pages is 0 on every rank.
func waitPoolsFree(t *testing.T, eng *serve.Engine) {
	t.Helper()
	waitIdle(t, eng)
	waitfor.NoError(t, "the KV pools free", 20*time.Second, func() error {
		free := true
		var state []string
		for r := range eng.View().Ranks() {
			used, cached, total := eng.View().KVPages(r)
			state = append(state, fmt.Sprintf("rank %d: %d used, %d cached of %d", r, used, cached, total))
			free = free && used == cached && cached <= total
		}
		if !free {
			return errors.New(strings.Join(state, "; "))
		}
		return nil
	})
	if eng.Config().DisablePrefixCache {
		for r := range eng.View().Ranks() {
			if _, cached, _ := eng.View().KVPages(r); cached != 0 {
				t.Errorf("rank %d: %d cached pages with the prefix cache off", r, cached)
			}
		}
	}
}

// tokenBodies are greedy completion requests for seeded token prompts.
func tokenBodies(seed uint64, n, minLen, maxLen, maxTok int) []map[string]any {
	var bodies []map[string]any
	for i, p := range testmodel.Prompts(seed, n, minLen, maxLen, 512) {
		bodies = append(bodies, map[string]any{"prompt": p, "max_tokens": maxTok, "temperature": 0, "ignore_eos": i%2 == 1})
	}
	return bodies
}

// TP=1 and TP=2 serve the same greedy outputs, streamed or not, with a
// roomy KV pool and with one small enough to force retractions.
func TestTPEquality(t *testing.T) {
	bodies := tokenBodies(21, 16, 3, 40, 12)
	var want []result
	for _, small := range []bool{false, true} {
		for _, tp := range []int{1, 2} {
			name := fmt.Sprintf("tp%d", tp)
			cfg := serve.Config{TP: tp, PageSize: 4, MaxRunning: 8}
			if small {
				name += "-small-pool"
				cfg = serve.Config{TP: tp, PageSize: 4, KVTokens: 96, MaxRunning: 6, MaxBatchTokens: 24, PrefillChunk: 7}
			}
			t.Run(name, func(t *testing.T) {
				e := newEnvCfg(t, cfg)
				got := runAll(t, e, "/v1/completions", bodies)
				if want == nil {
					want = got
					nonEmpty := 0
					for _, r := range got {
						if r.Text != "" {
							nonEmpty++
						}
					}
					if nonEmpty < len(got)/2 {
						t.Fatalf("only %d of %d completions have text: a weak test", nonEmpty, len(got))
					}
				} else {
					checkSame(t, name, got, want)
				}
				waitPoolsFree(t, e.eng)
				tot := e.eng.View().Snapshot().Totals
				t.Logf("totals %+v", tot)
				if small && tot.Retractions == 0 {
					t.Error("no retraction: the small pool did not force the recompute path")
				}
				// The debug API reports the same counts.
				var st debug.StateResponse
				if code, b := get(t, e, "/debug/v1/state"); code != 200 || json.Unmarshal(b, &st) != nil || st.Snapshot == nil ||
					st.Snapshot.Totals.Retractions != tot.Retractions || st.Settings.TPSize != tp {
					t.Errorf("/debug/v1/state: %d %.300s", code, b)
				}
			})
		}
	}
}

// sharedPrefixBodies are greedy requests whose prompts share a 48-token
// prefix, each with its own suffix.
func sharedPrefixBodies(n int) []map[string]any {
	shared := testmodel.Prompts(31, 1, 48, 48, 512)[0]
	var bodies []map[string]any
	for i, s := range testmodel.Prompts(32, n, 1, 10, 512) {
		p := append(slices.Clone(shared), s...)
		bodies = append(bodies, map[string]any{"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": i%3 == 0})
	}
	return bodies
}

// chatBodies are greedy chat requests that share a long system message.
func chatBodies(n int) []map[string]any {
	system := "You are a careful assistant for a small robot workshop. Answer in short sentences, name every part you use, and never guess a measurement."
	var bodies []map[string]any
	for i := range n {
		msgs := []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": fmt.Sprintf("Question %d: how do I fix wheel %d?", i, i*7)}}
		bodies = append(bodies, map[string]any{"messages": msgs, "max_tokens": 8, "temperature": 0})
	}
	return bodies
}

// The prefix cache changes no output: prompts sharing a long prefix, in two
// waves so that the second reads the first's cached pages, give the same
// completions and chat completions with the cache on and off; and the cache
// was really used when on.
func TestPrefixCacheEquality(t *testing.T) {
	bodies := sharedPrefixBodies(16)
	chats := chatBodies(8)
	type outputs struct{ wave1, wave2, chat1, chat2 []result }
	run := func(t *testing.T, disable bool) outputs {
		e := newEnvCfg(t, serve.Config{PageSize: 4, MaxRunning: 8, DisablePrefixCache: disable})
		var o outputs
		o.wave1 = runAll(t, e, "/v1/completions", bodies[:4])
		waitPoolsFree(t, e.eng)
		before := e.eng.View().Snapshot().Totals
		o.wave2 = runAll(t, e, "/v1/completions", bodies[4:])
		waitPoolsFree(t, e.eng)
		mid := e.eng.View().Snapshot().Totals
		o.chat1 = runAll(t, e, "/v1/chat/completions", chats[:2])
		waitPoolsFree(t, e.eng)
		chatBefore := e.eng.View().Snapshot().Totals
		o.chat2 = runAll(t, e, "/v1/chat/completions", chats[2:])
		waitPoolsFree(t, e.eng)
		after := e.eng.View().Snapshot().Totals
		t.Logf("totals %+v", after)
		if disable {
			if after.CachedTokens != 0 || after.PrefixHits != 0 {
				t.Errorf("prefix cache off, yet %d cached tokens and %d hits", after.CachedTokens, after.PrefixHits)
			}
			return o
		}
		// Each request of the second wave (sent twice: streamed and not)
		// finds at least the 48 shared tokens cached.
		n := uint64(2 * len(bodies[4:]))
		if hits := mid.PrefixHits - before.PrefixHits; hits < n {
			t.Errorf("second wave: %d prefix hits, want %d", hits, n)
		}
		if c := mid.CachedTokens - before.CachedTokens; c < 48*n {
			t.Errorf("second wave: %d cached tokens, want at least %d", c, 48*n)
		}
		n = uint64(2 * len(chats[2:]))
		if hits := after.PrefixHits - chatBefore.PrefixHits; hits < n {
			t.Errorf("second chat wave: %d prefix hits, want %d", hits, n)
		}
		if after.CachedTokens <= chatBefore.CachedTokens {
			t.Error("second chat wave read no cached token")
		}
		return o
	}
	var on, off outputs
	t.Run("on", func(t *testing.T) { on = run(t, false) })
	t.Run("off", func(t *testing.T) { off = run(t, true) })
	checkSame(t, "wave 1", on.wave1, off.wave1)
	checkSame(t, "wave 2", on.wave2, off.wave2)
	checkSame(t, "chat wave 1", on.chat1, off.chat1)
	checkSame(t, "chat wave 2", on.chat2, off.chat2)
}

// 64 clients disconnect at seeded random moments (before the first byte,
// while their prompt is prefilling, while decoding), among a few that run
// to their end: the completed ones are right, every rank's KV pool ends
// fully free and the server still serves.
func TestDisconnectStorm(t *testing.T) {
	for _, tp := range []int{1, 2} {
		t.Run(fmt.Sprint("tp", tp), func(t *testing.T) { disconnectStorm(t, tp) })
	}
}

func disconnectStorm(t *testing.T, tp int) {
	e := newEnvCfg(t, serve.Config{TP: tp, PageSize: 4, KVTokens: 1024, MaxRunning: 8, MaxBatchTokens: 64, PrefillChunk: 16})
	const clients = 64
	rng := rand.New(rand.NewPCG(uint64(tp), 77))
	// Long prompts (several prefill chunks) sharing a prefix, so that
	// aborted sequences also leave pages in the prefix cache.
	shared := testmodel.Prompts(41, 1, 24, 24, 512)[0]
	// Every prompt has its own length: the length names a request in the
	// engine's snapshot before its stream has told its id.
	suffixes := testmodel.Prompts(42, clients, 100, 100, 512)
	lens := rng.Perm(clients)
	type client struct {
		kind   int // 0 before the first byte, 1 prefilling, 2 decoding, 3 completes
		stream bool
		delay  time.Duration // kind 0
		events int           // kind 2
		body   map[string]any
	}
	cs := make([]client, clients)
	for i := range cs {
		c := client{kind: rng.IntN(4), stream: rng.IntN(2) == 0}
		p := append(slices.Clone(shared), suffixes[i][:20+lens[i]]...)
		c.body = map[string]any{"prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": true}
		switch c.kind {
		case 0:
			c.delay = time.Duration(rng.IntN(10000)) * time.Microsecond
		case 1:
			c.stream = true // the stream's id names the request in the engine
		case 2:
			c.stream, c.events = true, 1+rng.IntN(10)
		case 3:
			c.body["max_tokens"] = 6
		}
		cs[i] = c
	}
	// What the completing clients must get.
	want := map[int]result{}
	for i, c := range cs {
		if c.kind == 3 {
			r, err := e.completeErr("/v1/completions", c.body)
			if err != nil {
				t.Fatal(err)
			}
			want[i] = r
		}
	}
	probe := map[string]any{"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
	wantProbe, err := e.completeErr("/v1/completions", probe)
	if err != nil {
		t.Fatal(err)
	}
	waitPoolsFree(t, e.eng)
	before := e.eng.View().Snapshot().Totals

	var hitPrefill, hitDecode atomic.Int32
	var wg sync.WaitGroup
	for i, c := range cs {
		wg.Go(func() {
			if c.kind == 3 {
				var r result
				var err error
				if c.stream {
					r, err = e.streamErr("/v1/completions", c.body)
				} else {
					r, err = e.completeErr("/v1/completions", c.body)
				}
				if err != nil || r != want[i] {
					t.Errorf("client %d (stream %v): got %+v %v, want %+v", i, c.stream, r, err, want[i])
				}
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			body := maps(c.body)
			body["stream"] = c.stream
			b, _ := json.Marshal(body)
			req, _ := http.NewRequestWithContext(ctx, "POST", e.ts.URL+"/v1/completions", bytes.NewReader(b))
			if c.kind == 0 && !c.stream {
				// Gone at a random moment before the response:
				// before the engine saw it or while it is in there.
				time.AfterFunc(c.delay, cancel)
			}
			resp, err := e.ts.Client().Do(req)
			if err != nil {
				if c.kind != 0 {
					t.Errorf("client %d: %v", i, err)
				}
				return
			}
			defer resp.Body.Close()
			if c.kind == 0 {
				if c.stream {
					// Submitted (the headers came), gone before the
					// first byte of the body.
					cancel()
				}
				io.Copy(io.Discard, resp.Body) // ends when cancel fires
				return
			}
			rd := bufio.NewReader(resp.Body)
			readEvent := func() (openai.CompletionChunk, bool) {
				for {
					line, err := rd.ReadString('\n')
					if err != nil {
						return openai.CompletionChunk{}, false
					}
					if data, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok && data != "[DONE]" {
						var ch openai.CompletionChunk
						return ch, json.Unmarshal([]byte(data), &ch) == nil
					}
				}
			}
			switch c.kind {
			case 1:
				// The headers came once the request was submitted; its
				// id is known from the first event only, so find it by
				// its prompt length.
				if waitPrefilling(e.eng, len(c.body["prompt"].([]int32))) {
					hitPrefill.Add(1)
				}
			case 2:
				n := 0
				for n < c.events {
					if _, ok := readEvent(); !ok {
						break // finished first: fine, not counted
					}
					n++
				}
				if n == c.events {
					hitDecode.Add(1)
				}
			}
			cancel()
		})
	}
	wg.Wait()
	waitPoolsFree(t, e.eng)
	after := e.eng.View().Snapshot().Totals
	kinds := [4]int{}
	for _, c := range cs {
		kinds[c.kind]++
	}
	t.Logf("clients by kind %v; cancelled while prefilling %d, while decoding %d; aborts %d (%d in step), cached tokens %d, evictions %d",
		kinds, hitPrefill.Load(), hitDecode.Load(), after.Aborts-before.Aborts, after.AbortsInStep-before.AbortsInStep,
		after.CachedTokens-before.CachedTokens, after.PrefixEvictions-before.PrefixEvictions)
	if after.Aborts-before.Aborts < uint64(kinds[1]+int(hitDecode.Load())) {
		t.Errorf("%d aborts, want at least %d", after.Aborts-before.Aborts, kinds[1]+int(hitDecode.Load()))
	}
	if hitDecode.Load() == 0 {
		t.Error("no client disconnected while decoding")
	}
	// The server still serves, and right.
	if got, err := e.completeErr("/v1/completions", probe); err != nil || got != wantProbe {
		t.Errorf("after the storm: %+v %v, want %+v", got, err, wantProbe)
	}
	if got, err := e.streamErr("/v1/completions", probe); err != nil || got != wantProbe {
		t.Errorf("after the storm, streamed: %+v %v, want %+v", got, err, wantProbe)
	}
	waitPoolsFree(t, e.eng)
}

// waitPrefilling waits (a bounded time) until the request with a prompt of
// n tokens is prefilling, or past that; it reports whether it saw it
// prefilling.
func waitPrefilling(eng *serve.Engine, n int) bool {
	seen, prefilling := false, false
	waitfor.Poll(10*time.Second, func() bool {
		q := eng.View().Snapshot().Queue
		find := func(rs []sched.ReqInfo) bool {
			return slices.ContainsFunc(rs, func(r sched.ReqInfo) bool { return r.PromptLen == n })
		}
		switch {
		case find(q.Prefilling):
			prefilling = true
			return true
		case find(q.Waiting):
			seen = true
		case find(q.Running) || find(q.Aborting):
			return true // past it
		case seen:
			return true // gone
		}
		return false
	})
	return prefilling
}
