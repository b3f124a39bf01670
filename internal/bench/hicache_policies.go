package bench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/serve"
)

// HiCachePolicies is the write-policy part: the workload HiCache exists
// for (many prompts whose prefixes leave the device before they come
// back) with HiCache off and under each policy, in one run.
type HiCachePolicies struct {
	PoolTokens int // the device pool, tokens per rank
	Requests   int // of each setup
	Setups     []HiCachePolicySetup
}

// HiCachePolicySetup is one setup's figures; the first is HiCache off.
type HiCachePolicySetup struct {
	Name string // "off" or the policy's name
	// HostHits are the requests that loaded a prefix back from host,
	// HitTokens the tokens they loaded.
	HostHits, HitTokens uint64
	// Backups and BackupBytes are the pages backed up to host, and their
	// bytes (rank 0).
	Backups, BackupBytes uint64
	// TTFT percentiles over every request, milliseconds.
	TTFTP50, TTFTP99 float64
	// DecodeStepMS is the mean time of a decode step (rank 0), which the
	// backups copy beside; DecodeTokensPerSecond the generated tokens over
	// the decode steps' time.
	DecodeStepMS, DecodeTokensPerSecond float64
	Differ                              int // outputs other than HiCache off's
	Elapsed                             time.Duration
}

// HitRate is the share of requests that were host hits.
func (s HiCachePolicySetup) HitRate(requests int) float64 {
	return ratio(float64(s.HostHits), float64(requests))
}

// runHiCachePolicies runs the policy part: PolicyPrompts prompts of
// PolicyPrompt tokens, each sent PolicyRounds times in rounds, MaxRunning
// at a time, each generating PolicyTokens; the device pool holds two of
// them, the host tier 8 times the pool.
func runHiCachePolicies(ctx context.Context, m *model.Model, cfg HiCacheConfig, log *slog.Logger, progress io.Writer) (HiCachePolicies, error) {
	rng := rand.New(rand.NewPCG(cfg.Seed, 2<<32))
	prompts := make([][]int32, cfg.PolicyPrompts)
	for i := range prompts {
		prompts[i] = randTokens(rng, cfg.PolicyPrompt, m.Config.VocabSize)
	}
	out := HiCachePolicies{PoolTokens: roundUp(2*(cfg.PolicyPrompt+cfg.PolicyTokens), cfg.PageSize), Requests: cfg.PolicyRounds * len(prompts)}
	fmt.Fprintf(progress, "policies: %d prompts of %d tokens, each sent %d times, %d at a time, %d tokens each; device pool %d tokens per rank, host 8×\n",
		len(prompts), cfg.PolicyPrompt, cfg.PolicyRounds, cfg.MaxRunning, cfg.PolicyTokens, out.PoolTokens)
	setups := append([]*prefix.Policy{nil}, ptrs(cfg.Policies)...)
	var ref [][]int32
	for _, pol := range setups {
		ec := hcEngineConfig(cfg, log)
		ec.MaxRunning, ec.KVTokens = cfg.MaxRunning, out.PoolTokens
		name := "off"
		if pol != nil {
			ec.HiCache = serve.HiCacheConfig{Enabled: true, Ratio: 8, Policy: *pol}
			name = pol.String()
		}
		tally := &decodeTally{}
		ec.Observer = tally
		e, err := serve.New(m, ec)
		if err != nil {
			return out, fmt.Errorf("bench: policy engine: %w", err)
		}
		st, got, err := policyRun(ctx, e, cfg, prompts)
		if err != nil {
			e.Close()
			return out, err
		}
		if pol != nil {
			ts, err := quietTier(ctx, e, uint64(out.Requests))
			if err != nil {
				e.Close()
				return out, err
			}
			t := ts.Totals
			st.HostHits, st.HitTokens, st.Backups, st.BackupBytes = t.HostHits, t.HitTokens, t.Backups, t.BackupBytes
		}
		e.Close()
		st.Name = name
		if tokens, steps, busy := tally.take(); steps > 0 {
			st.DecodeStepMS = ms(busy) / float64(steps)
			st.DecodeTokensPerSecond = float64(tokens) / busy.Seconds()
		}
		if ref == nil {
			ref = got
		}
		for i := range got {
			if !slices.Equal(got[i], ref[i]) {
				st.Differ++
			}
		}
		fmt.Fprintf(progress, "policies: %s: %d host hits, %d backups, TTFT p50 %.1f ms, decode step %.2f ms\n", name, st.HostHits, st.Backups, st.TTFTP50, st.DecodeStepMS)
		out.Setups = append(out.Setups, st)
	}
	return out, nil
}

func ptrs[T any](xs []T) []*T {
	out := make([]*T, len(xs))
	for i := range xs {
		out[i] = &xs[i]
	}
	return out
}

// policyRun sends the rounds and returns the setup's TTFTs and every
// request's tokens, in round order.
func policyRun(ctx context.Context, e *serve.Engine, cfg HiCacheConfig, prompts [][]int32) (HiCachePolicySetup, [][]int32, error) {
	var st HiCachePolicySetup
	got := make([][]int32, cfg.PolicyRounds*len(prompts))
	ttft := make([]float64, len(got))
	start := time.Now()
	for r := range cfg.PolicyRounds {
		next := make(chan int, len(prompts))
		for i := range prompts {
			next <- i
		}
		close(next)
		var wg sync.WaitGroup
		errs := make([]error, cfg.MaxRunning)
		for w := range cfg.MaxRunning {
			wg.Go(func() {
				for i := range next {
					o, err := hcDo(ctx, e, prompts[i], cfg.PolicyTokens, cfg.RequestTimeout)
					if err == nil && o.reason != "length" {
						err = fmt.Errorf("bench: policy request ended %q (engine: %s)", o.reason, e.View().Snapshot().Err)
					}
					if err != nil {
						errs[w] = err
						return
					}
					k := r*len(prompts) + i
					got[k], ttft[k] = o.tokens, ms(o.ttft)
				}
			})
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				return st, nil, err
			}
		}
	}
	st.Elapsed = time.Since(start)
	slices.Sort(ttft)
	st.TTFTP50, st.TTFTP99 = percentile(ttft, 50), percentile(ttft, 99)
	return st, got, nil
}

// print writes the policy part.
func (p *HiCachePolicies) print(w io.Writer, c HiCacheConfig) {
	fmt.Fprintf(w, "\nwrite policies: %d prompts of %d tokens, each sent %d times in rounds, %d at a time, %d greedy tokens each; device pool %d tokens per rank (two prompts), host tier 8× it; %d requests per setup\n\n",
		c.PolicyPrompts, c.PolicyPrompt, c.PolicyRounds, c.MaxRunning, c.PolicyTokens, p.PoolTokens, p.Requests)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "setup\thost hits\thit rate\tloaded tokens\tbackups\tbackup MB\tTTFT p50 ms\tTTFT p99 ms\tTTFT p50 / off\tdecode step ms\tdecode tok/s\t/ off\tdiffer\ts\t\n")
	var off HiCachePolicySetup
	for i, s := range p.Setups {
		if i == 0 {
			off = s
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f%%\t%d\t%d\t%.1f\t%.1f\t%.1f\t%.2f\t%.3f\t%.0f\t%.2f\t%d\t%.1f\t\n", s.Name, s.HostHits, 100*s.HitRate(p.Requests), s.HitTokens,
			s.Backups, float64(s.BackupBytes)/1e6, s.TTFTP50, s.TTFTP99, ratio(s.TTFTP50, off.TTFTP50), s.DecodeStepMS, s.DecodeTokensPerSecond,
			ratio(s.DecodeTokensPerSecond, off.DecodeTokensPerSecond), s.Differ, s.Elapsed.Seconds())
	}
	tw.Flush()
	fmt.Fprintln(w, "\noff: HiCache off, every prefix that left the device is computed again; hit rate: host hits over requests; backups: pages copied to host (rank 0), on the writer's goroutine beside the steps")
	fmt.Fprintln(w, "decode step ms and tok/s: rank 0's decode steps alone, their mean time and the tokens they made over their time: a backup that delayed the steps shows there; / off: against HiCache off in the same run")
	for _, s := range p.Setups {
		if s.Differ > 0 {
			fmt.Fprintf(w, "FAIL: %s: %d outputs differ from HiCache off's\n", s.Name, s.Differ)
		}
	}
}
