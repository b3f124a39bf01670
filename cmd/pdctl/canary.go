package main

// diagnose's canaries (--canaries N): an active probe that diagnose runs
// beside its sampling only when asked. See diag.Canaries for what each
// canary does and rule output-divergence for how it is judged.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/diag"
)

const (
	// canaryMaxTokens is each canary output's length: greedy, with
	// end-of-sequence ignored, so every run of a prompt has as many tokens.
	canaryMaxTokens = 16
	// canaryMinTokens is the shortest canary prompt aimed at, in tokens,
	// and canaryMinPages in KV pages: longer than any built-in model's
	// indexer top-k (so the sparse indexer reads index-K) and over
	// several pages (so whole pages go to host and come back).
	canaryMinTokens = 256
	canaryMinPages  = 8
	// canaryBudget is how long the canaries may run past the window, all
	// together: a cluster under load queues them, a wedged one never
	// answers.
	canaryBudget = time.Minute
	// offloadWithin bounds the wait for a canary's prefix to be in the
	// cache whole (its prefill side may still be finishing when the
	// router answers).
	offloadWithin = 2 * time.Second
)

// canaryWords are what canary prompts are made of.
var canaryWords = strings.Fields(`river stone lantern quiet harbor amber falcon meadow copper willow
	signal orbit ember glacier thistle canyon marble beacon saffron tundra velvet anchor
	prism cedar hollow summit quartz ripple cobalt fern lattice ivory mosaic nectar pebble
	raven sable timber umber vapor wander zephyr basalt cinder delta fable grove`)

// canaryProbe sends diagnose's canaries: completions through via (the
// router, or a colocated server), offloads through the servers' admin API.
type canaryProbe struct {
	n       int
	seed    uint64
	via     string
	targets []*target
	hc      *http.Client
}

// newCanaryProbe returns the probe of n canaries from seed (0: one from the
// clock) for targets, sent through the router, or through the first
// colocated server when the servers were named with --server (a prefill or
// decode server takes no request without its router).
func newCanaryProbe(o *attachOptions, targets []*target, n int, seed uint64) (*canaryProbe, error) {
	via := ""
	if len(o.Servers) == 0 {
		via = strings.TrimRight(o.Router, "/")
	} else {
		for _, t := range targets {
			if t.Err == nil && t.Role == pdproto.RoleColocated {
				via = t.URL
				break
			}
		}
		if via == "" {
			return nil, &cannotRunError{err: errors.New("--canaries needs the router or a colocated --server: a prefill or decode server takes no request without its router")}
		}
	}
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	hc := o.HTTP
	if hc == nil {
		hc = &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 4}}
	}
	return &canaryProbe{n: n, seed: seed, via: via, targets: targets, hc: hc}, nil
}

// run sends the canaries one after another, within the window and the
// budget past it. It never fails as a whole: what could not run is each
// canary's Error.
func (p *canaryProbe) run(ctx context.Context, window time.Duration) *diag.Canaries {
	ctx, cancel := context.WithTimeout(ctx, window+canaryBudget)
	defer cancel()
	cs := &diag.Canaries{Via: p.via, Seed: p.seed, MaxTokens: canaryMaxTokens, HiCache: []string{}}
	tierOn, pageSize, ctxLen := p.survey(ctx)
	var offloadAt []*target // a decode's cache holds no prompt: the prefill's does
	for _, t := range tierOn {
		cs.HiCache = append(cs.HiCache, t.URL)
		if t.Role != pdproto.RoleDecode {
			offloadAt = append(offloadAt, t)
		}
	}
	words, err := p.promptWords(ctx, pageSize, ctxLen)
	for i := range p.n {
		c := diag.Canary{Index: i, Offloaded: map[string]int{}}
		if err != nil {
			c.Error = err.Error()
		} else {
			p.canary(ctx, &c, p.prompt(i, words), offloadAt, pageSize)
		}
		cs.Runs = append(cs.Runs, c)
	}
	return cs
}

// survey finds the servers whose host tier is on, in the order of the
// targets, the largest page size and the smallest context of the servers.
func (p *canaryProbe) survey(ctx context.Context) (tierOn []*target, pageSize, ctxLen int) {
	on := make([]bool, len(p.targets))
	var mu sync.Mutex
	var wg sync.WaitGroup
	pageSize = 1
	for i, t := range p.targets {
		if t.Err != nil {
			continue
		}
		wg.Go(func() {
			st, err := t.c.State(ctx)
			h, herr := t.c.HiCache(ctx)
			on[i] = herr == nil && h.On
			mu.Lock()
			defer mu.Unlock()
			if err == nil {
				pageSize = max(pageSize, st.Settings.PageSize)
				if st.ContextTokens > 0 && (ctxLen == 0 || st.ContextTokens < ctxLen) {
					ctxLen = st.ContextTokens
				}
			}
		})
	}
	wg.Wait()
	for i, t := range p.targets {
		if on[i] {
			tierOn = append(tierOn, t)
		}
	}
	return tierOn, pageSize, ctxLen
}

// promptWords sizes the canary prompts: it measures how many tokens a
// word takes on this model (one request of one token, no_cache) and
// returns the words for at least canaryMinTokens tokens and canaryMinPages
// pages, within three quarters of the context.
func (p *canaryProbe) promptWords(ctx context.Context, pageSize, ctxLen int) (int, error) {
	const probeWords = 32
	_, n, err := p.complete(ctx, p.promptOf("sizing pdctl diagnose canaries:", probeWords, 1<<32), 1, true)
	if err != nil {
		return 0, fmt.Errorf("sizing the prompts: %w", err)
	}
	want := max(canaryMinTokens, canaryMinPages*pageSize)
	if ctxLen > 0 {
		want = min(want, (ctxLen-canaryMaxTokens)*3/4)
	}
	perWord := float64(max(n, 1)) / probeWords
	return max(int(float64(want)/perWord)+1, 1), nil
}

// prompt is canary i's prompt: a header unique to the canary and the seed
// from its first word on, so that no other prompt shares its first KV page
// (an offload leaves a shared page on the device), then words seeded
// words.
func (p *canaryProbe) prompt(i, words int) string {
	return p.promptOf(fmt.Sprintf("%d-%d pdctl diagnose canary:", i, p.seed), words, uint64(i))
}

func (p *canaryProbe) promptOf(header string, words int, stream uint64) string {
	rng := rand.New(rand.NewPCG(p.seed, stream))
	var b strings.Builder
	b.WriteString(header)
	for range words {
		b.WriteString(" " + canaryWords[rng.IntN(len(canaryWords))])
	}
	return b.String()
}

// canary runs one canary: send, offload, send again, send with no_cache.
func (p *canaryProbe) canary(ctx context.Context, c *diag.Canary, prompt string, offloadAt []*target, pageSize int) {
	var err error
	if c.First, c.PromptTokens, err = p.complete(ctx, prompt, canaryMaxTokens, false); err != nil {
		c.Error = "first: " + err.Error()
		return
	}
	whole := c.PromptTokens / pageSize * pageSize
	for _, t := range offloadAt {
		c.Offloaded[t.URL] = 0
	}
	// The prompt's prefill side may still hold its last pages when the
	// router answers (they join the cache as it ends), and an offload takes
	// nothing from a path whose deepest page is held: offload until the
	// prompt's whole pages went. Each call answers what it moved.
	deadline := time.Now().Add(offloadWithin)
	for len(offloadAt) > 0 {
		moved := 0
		for _, t := range offloadAt {
			n, err := canaryOffload(ctx, t, prompt)
			if err != nil {
				c.Error = "offload: " + err.Error()
				return
			}
			c.Offloaded[t.URL] += n
			moved += n
		}
		most := 0
		for _, n := range c.Offloaded {
			most = max(most, n)
		}
		if most >= whole || most > 0 && moved == 0 || time.Now().After(deadline) {
			break
		}
		if !canarySleep(ctx, 20*time.Millisecond) {
			c.Error = "offload: " + ctx.Err().Error()
			return
		}
	}
	if c.LoadedBack, _, err = p.complete(ctx, prompt, canaryMaxTokens, false); err != nil {
		c.Error = "loaded back: " + err.Error()
		return
	}
	if c.Reference, _, err = p.complete(ctx, prompt, canaryMaxTokens, true); err != nil {
		c.Error = "no_cache: " + err.Error()
	}
}

// canaryOffload moves prompt's cached prefix to t's host tier and returns the
// tokens on host; another offload waiting there is waited out, and a tier
// switched off since the survey offloads nothing.
func canaryOffload(ctx context.Context, t *target, prompt string) (int, error) {
	c := *t.c
	c.Timeout = 30 * time.Second // the loops take it at their next iteration, however busy
	for {
		r, err := c.OffloadHiCache(ctx, debug.HiCacheOffloadRequest{Prompt: prompt})
		var ae *client.APIError
		switch {
		case err == nil:
			return r.OffloadedTokens, nil
		case errors.As(err, &ae) && ae.Status == http.StatusConflict && strings.Contains(ae.Message, "another offload"):
			if !canarySleep(ctx, 20*time.Millisecond) {
				return 0, err
			}
		case errors.As(err, &ae) && ae.Status == http.StatusConflict:
			return 0, nil // switched off since: nothing loads back
		default:
			return 0, err
		}
	}
}

// complete sends a greedy completion of prompt through the probe's
// endpoint and returns its text and prompt tokens. A cluster at capacity
// (429, or 503 while starting) is waited out as its Retry-After says,
// within ctx.
func (p *canaryProbe) complete(ctx context.Context, prompt string, maxTokens int, noCache bool) (string, int, error) {
	body, err := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTokens, "temperature": 0,
		"ignore_eos": true, "no_cache": noCache})
	if err != nil {
		return "", 0, err
	}
	u := p.via + "/v1/completions"
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
		if err != nil {
			return "", 0, err
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := p.hc.Do(req)
		if err != nil {
			return "", 0, fmt.Errorf("POST %s: %w", u, err)
		}
		b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if err != nil {
			return "", 0, fmt.Errorf("POST %s: reading the answer: %w", u, err)
		}
		switch resp.StatusCode {
		case http.StatusOK:
			var r openai.CompletionResponse
			if err := json.Unmarshal(b, &r); err != nil || len(r.Choices) != 1 {
				return "", 0, fmt.Errorf("POST %s: not a completion: %.200s", u, b)
			}
			if f := r.Choices[0].FinishReason; f != openai.FinishLength {
				return "", 0, fmt.Errorf("POST %s: finished %q after %d tokens, not at max_tokens", u, f, r.Usage.CompletionTokens)
			}
			return r.Choices[0].Text, r.Usage.PromptTokens, nil
		case http.StatusTooManyRequests, http.StatusServiceUnavailable:
			wait := time.Second
			if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
				wait = min(time.Duration(s)*time.Second, 5*time.Second)
			}
			if !canarySleep(ctx, wait) {
				return "", 0, fmt.Errorf("POST %s: %d, then %w", u, resp.StatusCode, ctx.Err())
			}
		default:
			return "", 0, fmt.Errorf("POST %s: %d %s", u, resp.StatusCode, openai.ParseError(resp.StatusCode, b).Message)
		}
	}
}

// canarySleep sleeps d unless ctx ends first; it reports whether it slept.
func canarySleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// canaryReport is what diagnose says on stderr of its canaries: how they
// ran, where HiCache was on, how many differ, and why any could not run.
func canaryReport(cs *diag.Canaries) string {
	var b strings.Builder
	ran, differ := 0, 0
	minP, maxP := 0, 0
	for _, c := range cs.Runs {
		if c.Error != "" {
			continue
		}
		if ran == 0 {
			minP, maxP = c.PromptTokens, c.PromptTokens
		}
		ran++
		minP, maxP = min(minP, c.PromptTokens), max(maxP, c.PromptTokens)
		if c.Diverged() {
			differ++
		}
	}
	prompts := strconv.Itoa(minP)
	if maxP != minP {
		prompts += "–" + strconv.Itoa(maxP)
	}
	fmt.Fprintf(&b, "%s through %s (seed %d, prompts of %s tokens, %d greedy tokens each): ",
		pluralf(len(cs.Runs), "canary", "canaries"), cs.Via, cs.Seed, prompts, cs.MaxTokens)
	if len(cs.HiCache) == 0 {
		b.WriteString("hicache is off on every server, so nothing loads back from host: each compares a cache hit with no_cache; ")
	} else {
		b.WriteString("hicache on at " + strings.Join(cs.HiCache, ", ") + "; ")
	}
	fmt.Fprintf(&b, "%d of %d differ\n", differ, ran)
	for _, c := range cs.Runs {
		if c.Error != "" {
			fmt.Fprintf(&b, "canary %d could not run: %s\n", c.Index, c.Error)
		}
	}
	return b.String()
}
