package router

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/canary"
	"github.com/prometheus/client_golang/prometheus"
)

// The router's canaries: correctness probes (package canary's method) it
// sends without being asked, at Options.CanaryInterval (one a minute by
// default), through a prefill and a decode server as any request, so that
// corrupt KV is found without pdctl diagnose --canaries. Each canary is a
// prompt of its own, a few hundred tokens long (over several KV pages,
// longer than an indexer's top-k), sized to the servers' context; the
// prefill's host tier takes it through POST /admin/v1/hicache/offload, with
// the cluster secret's admin token (where the tier is off, or the call is
// refused, the canary compares a device cache hit instead). A canary is skipped while the pair has no
// room (it never takes a client's place) and marked "probe": the servers
// leave it out of their metrics and readiness, and the router out of its
// requests, latencies, in-flight gauge and readiness; only
// pdkit_router_canaries_total counts it.

// Canary results, the result label of pdkit_router_canaries_total.
const (
	CanaryMatch    = canary.Match
	CanaryMismatch = canary.Mismatch
	CanarySkipped  = canary.Skipped
	CanaryFailed   = canary.Failed
)

// DefaultCanaryInterval is Options.CanaryInterval's default.
const DefaultCanaryInterval = time.Minute

// canaryTokens is how many greedy tokens each send of a canary asks for.
const canaryTokens = 16

// canaries runs the probes and keeps their outcome.
type canaries struct {
	rt     *Router
	counts *prometheus.CounterVec
	tally  canary.Tally
}

func newCanaries(rt *Router) *canaries {
	c := &canaries{rt: rt,
		counts: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "pdkit", Subsystem: "router", Name: "canaries_total",
			Help: "The router's correctness probes (--canary-interval), by prefill server and result: match; mismatch (the cached or host-loaded " +
				"output differs from the computed one: corrupt KV); skipped (no room, or paused); failed (a request of it failed, not judged)."},
			[]string{"prefill", "result"}),
	}
	return c
}

// loop sends a canary every interval until ctx ends.
func (c *canaries) loop(ctx context.Context, interval time.Duration, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		c.probe(ctx, interval)
	}
}

// canaryBound is the least time a canary may take, whatever the interval:
// its four requests wait their turn on a busy pair like any request.
const canaryBound = 30 * time.Second

// probe sends one canary, bounded by the interval and at least canaryBound
// (the next one waits for it).
func (c *canaries) probe(parent context.Context, interval time.Duration) {
	ctx, cancel := context.WithTimeout(parent, max(interval, canaryBound))
	defer cancel()
	rt := c.rt
	if paused, _, _, _ := rt.gate.status(); paused || !rt.ready.Load() {
		c.count("", CanarySkipped, nil)
		return
	}
	p, _ := rt.choose(pdproto.RolePrefill, nil, true)
	if p == nil {
		c.count("", CanarySkipped, nil)
		return
	}
	defer rt.releaseProbe(p)
	d, _ := rt.choose(pdproto.RoleDecode, nil, true)
	if d == nil {
		c.count(p.url, CanarySkipped, nil)
		return
	}
	defer rt.releaseProbe(d)
	seed := c.tally.Next()
	_, pinfo := p.state()
	_, dinfo := d.state()
	prompt := canaryPrompt(seed, canaryBytes(pinfo.ContextTokens, dinfo.ContextTokens))
	result, cached, computed, err := canary.Run(ctx, canary.Steps{
		Send:    func(ctx context.Context, noCache bool) (string, error) { return c.send(ctx, p, d, prompt, noCache) },
		Offload: func(ctx context.Context) { c.offload(ctx, p, prompt) },
	})
	var m *debug.CanaryMismatch
	switch result {
	case CanaryFailed:
		rt.log.Warn("canary not judged: a request of it failed", "prefill", p.url, "err", err)
	case CanaryMismatch:
		m = &debug.CanaryMismatch{At: time.Now(), Prefill: p.url, Decode: d.url, Seed: seed, Cached: cached, Computed: computed}
		rt.log.Error("canary mismatch: the cached output differs from the computed one (corrupt KV)",
			"prefill", p.url, "decode", d.url, "seed", seed, "cached", cached, "computed", computed)
	}
	c.count(p.url, result, m)
}

func (c *canaries) count(prefill, result string, m *debug.CanaryMismatch) {
	c.counts.WithLabelValues(prefill, result).Inc()
	c.tally.Count(result, m)
}

// status is the canaries' outcome for /debug/v1/cluster; nil before the
// first.
func (c *canaries) status() *debug.Canaries { return c.tally.Status() }

// canaryMaxBytes bounds a canary's prompt: about 300 words, several KV
// pages and more than an indexer's top-k on the models pdkit runs.
const canaryMaxBytes = 2000

// canaryBytes is the size of a canary's prompt on servers whose contexts
// hold ctxA and ctxB tokens (0: not reported): a token stands for at least
// one byte, so a prompt of that many bytes, and the canary's tokens, fit.
func canaryBytes(ctxA, ctxB int) int {
	n := canaryMaxBytes
	for _, c := range []int{ctxA, ctxB} {
		if c > 0 {
			n = min(n, c-canaryTokens-8)
		}
	}
	return max(n, 16)
}

// canaryPrompt is canary seed's prompt of at most size bytes: words drawn
// from a small vocabulary, its own for each seed.
func canaryPrompt(seed uint64, size int) string {
	words := []string{"the", "river", "carried", "a", "lantern", "past", "seven", "quiet", "houses", "where", "nobody",
		"had", "slept", "since", "winter", "came", "early", "and", "stayed", "long", "over", "hills", "of", "grey", "stone"}
	r := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	var b strings.Builder
	fmt.Fprintf(&b, "canary %d:", seed)
	for {
		w := words[r.IntN(len(words))]
		if b.Len()+1+len(w) > size {
			return b.String()
		}
		b.WriteByte(' ')
		b.WriteString(w)
	}
}

// send sends the canary's prompt through p and d as the router sends a
// request (a room, both halves signed for their servers), greedy, marked a
// probe, and returns the decode's text.
func (c *canaries) send(ctx context.Context, p, d *upstream, prompt string, noCache bool) (string, error) {
	rt := c.rt
	room := rt.rooms.acquire()
	defer rt.rooms.release(room)
	_, pinfo := p.state()
	_, dinfo := d.state()
	fields := map[string]any{"prompt": prompt, "max_tokens": canaryTokens, "temperature": 0, "ignore_eos": true,
		"probe": true, "bootstrap_room": room}
	if noCache {
		fields["no_cache"] = true
	}
	pfields := clone(fields)
	pfields["stream"] = false
	dfields := clone(fields)
	dfields["bootstrap_url"] = pinfo.BootstrapURL
	pbody, _ := json.Marshal(pfields)
	dbody, _ := json.Marshal(dfields)
	src, _ := http.NewRequestWithContext(ctx, http.MethodPost, "/v1/completions", nil)
	id := "canary-" + newRequestID()
	perr := make(chan error, 1)
	go func() {
		resp, err := rt.post(ctx, p.url+"/v1/completions", pbody, src, id, pinfo.ID)
		if err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("prefill answered %d: %s", resp.StatusCode, summary(b))
			}
		}
		perr <- err
	}()
	resp, err := rt.post(ctx, d.url+"/v1/completions", dbody, src, id, dinfo.ID)
	if err != nil {
		<-perr
		return "", err
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	if pe := <-perr; pe != nil {
		return "", pe
	}
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("decode answered %d: %s", resp.StatusCode, summary(b))
	}
	var out struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) != 1 {
		return "", fmt.Errorf("decode answered %q", summary(b))
	}
	return out.Choices[0].Text, nil
}

// offload moves the canary's cached prefix to p's host tier.
func (c *canaries) offload(ctx context.Context, p *upstream, prompt string) {
	tok := c.rt.opts.ClusterSecret.AdminToken()
	body, _ := json.Marshal(debug.HiCacheOffloadRequest{Prompt: prompt})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+debug.HiCacheOffloadPath, bytes.NewReader(body))
	if err != nil {
		return
	}
	req.Header.Set("Content-Type", "application/json")
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := c.rt.client.Do(req)
	if err != nil {
		return
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
}

func clone(m map[string]any) map[string]any {
	out := make(map[string]any, len(m)+2)
	for k, v := range m {
		out[k] = v
	}
	return out
}
