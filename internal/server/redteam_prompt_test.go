package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/engine/tokenizer"
	"github.com/pdkit/pdkit/internal/procstat"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// countingTokenizer counts the prompts tokenized.
type countingTokenizer struct {
	tokenizer.Tokenizer
	n *atomic.Int64
}

func (c countingTokenizer) Encode(text string, addSpecial bool) ([]int32, error) {
	c.n.Add(1)
	return c.Tokenizer.Encode(text, addSpecial)
}

func (c countingTokenizer) EncodeWithSpecials(text string) ([]int32, error) {
	c.n.Add(1)
	return c.Tokenizer.(tokenizer.SpecialEncoder).EncodeWithSpecials(text)
}

// A prompt that cannot fit the context is refused before any of it is
// tokenized, whichever way it comes: text, token ids, chat messages (many,
// or long), the native API; and a body past what any prompt that fits
// could take is refused while it is read. Each refusal names what did not
// fit; nothing reaches the tokenizer.
func TestRedTeamOversizedPromptsRefusedBeforeTokenizing(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	var encoded atomic.Int64
	m.Tokenizer = countingTokenizer{m.Tokenizer, &encoded}
	e := newEnvModel(t, m, serve.Config{PageSize: 4, MaxRunning: 4})
	ctx := m.Config.ContextLen
	tb := e.srv.bound.TokenBytes
	fits := (ctx - 16) * tb // bytes that might fit with max_tokens 16
	t.Logf("context %d tokens, at most %d bytes a token: a prompt of more than %d bytes cannot fit; bodies are read to %d bytes",
		ctx, tb, fits, e.srv.limits.MaxBodyBytes)
	long := strings.Repeat("a", fits+1)
	ids := make([]int, ctx)
	many := make([]map[string]any, ctx)
	for i := range many {
		many[i] = map[string]any{"role": "user", "content": "hi"}
	}
	cases := []struct {
		name, path string
		body       any
		status     int
		want       string
	}{
		{"text", "/v1/completions", map[string]any{"prompt": long, "max_tokens": 16}, 400, "cannot fit the context length"},
		{"token ids", "/v1/completions", map[string]any{"prompt": ids, "max_tokens": 16}, 400, "exceeds the context length"},
		{"many messages", "/v1/chat/completions", map[string]any{"messages": many, "max_tokens": 16}, 400, "messages; with max_tokens 16"},
		{"long message", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": long}}, "max_tokens": 16}, 400, "cannot fit the context length"},
		{"long parts", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": []map[string]any{
			{"type": "text", "text": long[:fits/2]}, {"type": "text", "text": long[:fits/2+2]}}}}, "max_tokens": 16}, 400, "cannot fit the context length"},
		{"native", "/generate", map[string]any{"text": long, "sampling_params": map[string]any{"max_new_tokens": 16}}, 400, "cannot fit the context length"},
		{"a body no prompt that fits needs", "/v1/completions", map[string]any{"prompt": strings.Repeat("\u0001", int(e.srv.limits.MaxBodyBytes)/6+1)}, 413, "larger than"},
	}
	for _, c := range cases {
		before := encoded.Load()
		status, body := e.post(t, c.path, c.body)
		if status != c.status || !strings.Contains(string(body), c.want) {
			t.Errorf("%s: %d %s, want %d naming %q", c.name, status, body, c.status, c.want)
		}
		if n := encoded.Load() - before; n != 0 {
			t.Errorf("%s: %d prompts tokenized before the refusal", c.name, n)
		}
	}
	// A prompt that fits is served (the bound refuses nothing it should not).
	if got := e.complete(t, map[string]any{"prompt": "hello there", "max_tokens": 2, "temperature": 0}); len(got.Choices) != 1 {
		t.Errorf("a short prompt: %+v", got)
	}
}

// The server the memory test measures, in a child process of its own so
// that its peak resident set is its alone: it prints its URL and serves
// until its stdin closes.
func TestPromptMemoryChild(t *testing.T) {
	if os.Getenv("PDKIT_PROMPT_CHILD") == "" {
		t.Skip("the child of TestRedTeamOversizedPromptsCostNoMemory")
	}
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	eng, err := serve.New(m, withCPU(serve.Config{PageSize: 4, MaxRunning: 8}))
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(New(eng, m, Options{ModelName: "tiny"}))
	defer func() { ts.Close(); eng.Close() }()
	fmt.Printf("URL %s\n", ts.URL)
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// Eight 4 MB prompts at once, to a server whose model's context holds a
// few kilobytes of text, raise its peak resident set (VmHWM) by no more
// than 100 MB over its baseline: each body is read only as far as a
// prompt that fits could go and refused, none is tokenized (tokenizing
// one cost ~75× its size).
func TestRedTeamOversizedPromptsCostNoMemory(t *testing.T) {
	if _, err := procstat.Peak(0); err != nil {
		t.Skipf("no /proc here: %v", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPromptMemoryChild$", "-test.v")
	cmd.Env = append(os.Environ(), "PDKIT_PROMPT_CHILD=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	urls := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if u, ok := strings.CutPrefix(sc.Text(), "URL "); ok {
				urls <- u
			}
		}
		close(urls)
	}()
	var url string
	select {
	case u, ok := <-urls:
		if !ok {
			t.Fatal("the child server ended before it served")
		}
		url = u
	case <-time.After(2 * time.Minute):
		t.Fatal("the child server did not start within 2 minutes")
	}
	client := &http.Client{Timeout: time.Minute}
	post := func(body []byte) (int, error) {
		resp, err := client.Post(url+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	small, _ := json.Marshal(map[string]any{"prompt": "hello", "max_tokens": 4, "temperature": 0})
	for range 3 { // warm up: every path a request takes has run
		if st, err := post(small); err != nil || st != 200 {
			t.Fatalf("warm-up request: %d %v", st, err)
		}
	}
	base, err := procstat.Peak(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	huge, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("pdkit ", 4_000_000/6), "max_tokens": 16})
	var wg sync.WaitGroup
	statuses := make([]int, 8)
	for i := range statuses {
		wg.Go(func() {
			st, err := post(huge)
			if err != nil {
				// The server may close the connection once it has
				// refused the body; that is a refusal too.
				st = -1
			}
			statuses[i] = st
		})
	}
	wg.Wait()
	peak, err := procstat.Peak(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("8 prompts of %d bytes: statuses %v; peak resident %d MB before, %d MB after (+%d MB)",
		len(huge), statuses, base>>20, peak>>20, (peak-base)>>20)
	for i, st := range statuses {
		if st == 200 {
			t.Errorf("prompt %d was served", i)
		}
	}
	if peak-base > 100<<20 {
		t.Errorf("the peak resident set grew by %d MB, more than 100 MB", (peak-base)>>20)
	}
	if st, err := post(small); err != nil || st != 200 {
		t.Errorf("after the flood a small request: %d %v", st, err)
	}
}

// gatedTokenizer holds every Encode until its gate is closed, counting the
// calls in progress and the most at once.
type gatedTokenizer struct {
	tokenizer.Tokenizer
	gate          chan struct{}
	mu            *sync.Mutex
	now, most, in *int
}

func (g gatedTokenizer) Encode(text string, addSpecial bool) ([]int32, error) {
	g.mu.Lock()
	*g.now++
	*g.in++
	*g.most = max(*g.most, *g.now)
	g.mu.Unlock()
	<-g.gate
	g.mu.Lock()
	*g.now--
	g.mu.Unlock()
	return g.Tokenizer.Encode(text, addSpecial)
}

// Tokenizing is bounded in concurrency: with every place held, the next
// requests wait their turn (and are served once the places free), never
// tokenizing beside them; a waiting request whose client goes leaves.
func TestTokenizingIsBoundedInConcurrency(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	var mu sync.Mutex
	var now, most, in int
	gate := make(chan struct{})
	m.Tokenizer = gatedTokenizer{m.Tokenizer, gate, &mu, &now, &most, &in}
	e := newEnvModel(t, m, serve.Config{PageSize: 4, MaxRunning: 8})
	places := cap(e.srv.tokenize)
	n := places + 3
	var wg sync.WaitGroup
	statuses := make([]int, n)
	for i := range n {
		wg.Go(func() {
			statuses[i], _ = e.post(t, "/v1/completions", map[string]any{"prompt": "hello", "max_tokens": 2, "temperature": 0})
		})
	}
	waitfor.For(t, "every tokenizing place taken", 30*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return now == places
	})
	// A request that waits for a place, and whose client then goes.
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.ts.URL+"/v1/completions", strings.NewReader(`{"prompt":"hi","max_tokens":2}`))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		gone <- err
	}()
	cancel()
	if err := <-gone; err == nil {
		t.Error("the cancelled request was answered")
	}
	close(gate)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if most != places {
		t.Errorf("%d prompts tokenized at once, want the %d places", most, places)
	}
	for i, st := range statuses {
		if st != 200 {
			t.Errorf("request %d: %d", i, st)
		}
	}
	t.Logf("%d requests over %d places: at most %d at once; %d tokenized", n, places, most, in)
}

// The response ids of two servers never collide (behind one router, two
// decodes both number their requests from 1): each carries its server's
// instance tag, and a server takes an id with another's tag for none of
// its own (its abort of such an id answers 404).
func TestResponseIDsAreUniqueAcrossServers(t *testing.T) {
	a, b := newEnv(t), newEnv(t)
	body := map[string]any{"prompt": "hello", "max_tokens": 2, "temperature": 0}
	ra, rb := a.complete(t, body), b.complete(t, body)
	if ra.ID == rb.ID || !strings.HasPrefix(ra.ID, "cmpl-") || !strings.HasPrefix(rb.ID, "cmpl-") {
		t.Fatalf("ids %q and %q", ra.ID, rb.ID)
	}
	if b.srv.ownID(ra.ID) || !a.srv.ownID(ra.ID) || !b.srv.ownID("cmpl-7") || !b.srv.ownID("7") {
		t.Errorf("ownership of %q: a %v, b %v", ra.ID, a.srv.ownID(ra.ID), b.srv.ownID(ra.ID))
	}
	if id, ok := parseID(ra.ID); !ok || b.srv.idOf("cmpl-", id) == ra.ID {
		t.Errorf("%q parses to %d %v", ra.ID, id, ok)
	}
}
