package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/spf13/cobra"
)

type statusOptions struct {
	f      *factory
	Attach *attachOptions
	JSON   bool
	Now    func() time.Time
}

// newCmdStatus builds "pdctl status". Tests pass runF to capture the parsed
// options instead of running the command.
func newCmdStatus(f *factory, runF func(context.Context, *statusOptions) error) *cobra.Command {
	opts := &statusOptions{f: f, Attach: &f.attach, Now: time.Now}
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show every server and rank: role, index-K, health, readiness, loop liveness, queue depths, KV pages, host tier",
		Long: `Show the router (when the servers were discovered through it) and the servers
behind it (or the --server ones) with their role, TP size, model, index-K
precision (fp8 or bf16, "n/a" for a model without a sparse indexer, "fp8
(switching to bf16)" while a live switch drains), health (GET /health),
readiness (GET /readyz: "not ready" with the reason while the process
should get no traffic, e.g. when most of its recent requests failed though
every health check passes), request queues and GPUs (none, or count, model, mean utilization
and memory used), then one line per rank: its last step (number,
phase, age: the time since it ended), its PD queue depths on a prefill or
decode server, its KV pages (used by sequences/cached by the prefix cache/total,
as pdkit_kv_pages_used and pdkit_kv_pages_cached count them) and its host tier
(HiCache, GET /debug/v1/hicache): "off", or "on" with the host pool's tokens
used/total (blank without a prefix cache). The request queues (waiting,
prefilling, running, aborting, pending) are the server's.

A server that cannot be reached is a row saying so, the others are still
shown, and the exit status is 1.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return statusRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

// serverStatus is one server in the output of status (JSON as shown).
type serverStatus struct {
	URL     string `json:"url"`
	Role    string `json:"role"`
	TPSize  int    `json:"tp_size"`
	Model   string `json:"model"`
	Healthy bool   `json:"healthy"`
	Reason  string `json:"reason,omitempty"`
	// Ready is GET /readyz's verdict, ReadyReason why not; null when the
	// server did not say.
	Ready       *bool  `json:"ready,omitempty"`
	ReadyReason string `json:"ready_reason,omitempty"`
	// Error says why the server could not be read; its other fields are
	// what discovery knew.
	Error string `json:"error,omitempty"`
	// Requests counts the request queues, with "pending".
	Requests map[string]int `json:"requests,omitempty"`
	Ranks    []rankStatus   `json:"ranks,omitempty"`
	// GPU is what the server's NVML sees; null when it did not say.
	GPU *debug.GPUResponse `json:"gpu,omitempty"`
	// IndexK is the precision the sparse indexer's keys are stored in,
	// "n/a" when the model has no indexer, empty when the server did not
	// say; IndexKSwitch the precision of a live switch under way.
	IndexK       string `json:"index_k,omitempty"`
	IndexKSwitch string `json:"index_k_switch,omitempty"`
}

// rankStatus is one rank of a server.
type rankStatus struct {
	Rank  int    `json:"rank"`
	Step  uint64 `json:"step"`
	Phase string `json:"phase"`
	// StepAgeMS is the time since the rank's last step ended.
	StepAgeMS float64        `json:"step_age_ms"`
	PD        map[string]int `json:"pd,omitempty"`
	KV        debug.KVPages  `json:"kv"`
	// HiCache is the rank's host tier; null when the server did not say
	// (no prefix cache, or a server without the debug call).
	HiCache *rankHiCache `json:"hicache,omitempty"`
}

// rankHiCache is a rank's host tier: on or off, and its host pool's tokens
// used and in all (0 while off).
type rankHiCache struct {
	On         bool `json:"on"`
	TokensUsed int  `json:"host_tokens_used"`
	Tokens     int  `json:"host_tokens"`
}

type statusOutput struct {
	Router string `json:"router,omitempty"` // empty with --server
	// RouterStatus is the router's health and readiness (its URL, role
	// "router"); null with --server.
	RouterStatus *serverStatus  `json:"router_status,omitempty"`
	Servers      []serverStatus `json:"servers"`
}

// readReadiness asks GET /readyz: ready, or not with the reason; nil when
// the process did not say (no /readyz, or not reached).
func readReadiness(ctx context.Context, c *client.Client) (*bool, string) {
	err := c.GetJSON(ctx, "/readyz", nil)
	ready := err == nil
	var ae *client.APIError
	switch {
	case err == nil:
	case errors.As(err, &ae) && ae.Status == http.StatusServiceUnavailable:
		return &ready, ae.Message
	default:
		return nil, ""
	}
	return &ready, ""
}

// readRouter reads the router's health and readiness.
func readRouter(ctx context.Context, url string, c *client.Client) *serverStatus {
	s := &serverStatus{URL: url, Role: "router"}
	switch err := c.Health(ctx); {
	case err == nil:
		s.Healthy = true
	case client.StatusOf(err) != 0:
		var ae *client.APIError
		errors.As(err, &ae)
		s.Reason = ae.Message
	default:
		s.Error = err.Error()
		return s
	}
	s.Ready, s.ReadyReason = readReadiness(ctx, c)
	return s
}

// readStatus reads one server's steps, requests and (PD roles) PD state.
func readStatus(ctx context.Context, t *target, now func() time.Time) serverStatus {
	s := serverStatus{URL: t.URL, Role: t.Role, TPSize: t.TPSize, Model: t.Model, Healthy: t.Healthy, Reason: t.Reason}
	if t.Err != nil {
		s.Error, s.Healthy = t.Err.Error(), false
		return s
	}
	var (
		wg    sync.WaitGroup
		steps debug.StepsResponse
		reqs  debug.RequestsResponse
		pd    debug.PDResponse
		gpu   debug.GPUResponse
		gerr  error
		hc    debug.HiCacheResponse
		herr  error
		sets  debug.Settings
		serr  error
		errs  [3]error
	)
	wg.Go(func() { gpu, gerr = t.c.GPU(ctx) })       // optional: a failure leaves the column blank
	wg.Go(func() { hc, herr = t.c.HiCache(ctx) })    // optional too
	wg.Go(func() { sets, serr = t.c.Settings(ctx) }) // and so
	wg.Go(func() { s.Ready, s.ReadyReason = readReadiness(ctx, t.c) })
	wg.Go(func() { steps, errs[0] = t.c.Steps(ctx) })
	wg.Go(func() { reqs, errs[1] = t.c.Requests(ctx, "") })
	if isPD(t.Role) {
		wg.Go(func() { pd, errs[2] = t.c.PD(ctx, "") })
	}
	wg.Wait()
	if err := errors.Join(errs[:]...); err != nil {
		s.Error, s.Healthy = strings.ReplaceAll(err.Error(), "\n", "; "), false
		return s
	}
	at := now()
	if gerr == nil {
		s.GPU = &gpu
	}
	switch {
	case serr != nil:
	case !sets.Indexer:
		s.IndexK = "n/a"
	default:
		s.IndexK, s.IndexKSwitch = sets.IndexK, sets.IndexKSwitch
	}
	s.Requests = map[string]int{"pending": reqs.Pending}
	for _, q := range debug.Queues {
		s.Requests[q] = reqs.Counts[q]
	}
	for _, st := range steps.Ranks {
		r := rankStatus{Rank: st.Rank, Step: st.Step, Phase: st.Phase, KV: debug.KVPages{Rank: st.Rank}}
		if !st.End.IsZero() {
			r.StepAgeMS = float64(at.Sub(st.End).Microseconds()) / 1000
		}
		for _, kv := range reqs.KV {
			if kv.Rank == st.Rank {
				r.KV = kv
			}
		}
		for _, h := range hc.Ranks {
			if herr == nil && h.Rank == st.Rank {
				r.HiCache = &rankHiCache{On: h.On, TokensUsed: h.HostTokensUsed, Tokens: h.HostTokens}
			}
		}
		for _, pr := range pd.Ranks {
			if pr.Rank == st.Rank {
				r.PD = map[string]int{}
				for _, q := range debug.PDQueuesOf(t.Role) {
					r.PD[q] = pr.Counts[q]
				}
			}
		}
		s.Ranks = append(s.Ranks, r)
	}
	slices.SortFunc(s.Ranks, func(a, b rankStatus) int { return a.Rank - b.Rank })
	return s
}

func statusRun(ctx context.Context, opts *statusOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	out := statusOutput{Servers: make([]serverStatus, len(targets))}
	if len(opts.Attach.Servers) == 0 {
		out.Router = opts.Attach.Router
	}
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() { out.Servers[i] = readStatus(ctx, t, opts.Now) })
	}
	if rc := opts.Attach.routerClient(f); rc != nil {
		wg.Go(func() { out.RouterStatus = readRouter(ctx, opts.Attach.Router, rc) })
	}
	wg.Wait()
	unreachable := 0
	for _, s := range out.Servers {
		if s.Error != "" {
			unreachable++
		}
	}
	if opts.JSON {
		err = writeJSON(f.Out, out)
	} else {
		err = printTables(f, statusTables(out)...)
	}
	if err != nil {
		return err
	}
	if unreachable > 0 {
		return &unreachableError{n: unreachable, of: len(targets)}
	}
	return nil
}

func statusTables(out statusOutput) []*table {
	servers := newTable([]string{"SERVER", "ROLE", "TP", "MODEL", "INDEX-K", "HEALTH", "READY", "WAITING", "PREFILLING", "RUNNING", "ABORTING", "PENDING", "GPU"})
	ranks := newTable([]string{"SERVER", "RANK", "STEP", "PHASE", "AGE", "PD QUEUES", "KV USED/CACHED/TOTAL", "HICACHE TOKENS"}, "STEP", "AGE")
	if r := out.RouterStatus; r != nil {
		servers.add(r.URL, r.Role, "", "", "", healthCell(*r), readyCell(*r))
	}
	for _, s := range out.Servers {
		row := []string{s.URL, s.Role, tpCell(s.TPSize), s.Model, indexKCell(s.IndexK, s.IndexKSwitch), healthCell(s), readyCell(s)}
		if s.Requests != nil {
			for _, q := range append(slices.Clone(debug.Queues), "pending") {
				row = append(row, itoa(s.Requests[q]))
			}
			row = append(row, gpuCell(s.GPU))
		}
		servers.add(row...)
		for _, r := range s.Ranks {
			var pd []string
			for _, q := range debug.PDQueuesOf(s.Role) {
				if r.PD != nil {
					pd = append(pd, fmt.Sprintf("%s=%d", q, r.PD[q]))
				}
			}
			ranks.add(s.URL, itoa(r.Rank), fmt.Sprint(r.Step), r.Phase, fmtMS(r.StepAgeMS), strings.Join(pd, " "),
				fmt.Sprintf("%d/%d/%d", r.KV.Held(), r.KV.Cached, r.KV.Total), hicacheCell(r.HiCache))
		}
	}
	return []*table{servers, ranks}
}

// healthCell is a process's HEALTH cell.
func healthCell(s serverStatus) string {
	switch {
	case s.Error != "":
		return "unreachable: " + s.Error
	case !s.Healthy && s.Reason != "":
		return "unhealthy: " + s.Reason
	case !s.Healthy:
		return "unhealthy"
	}
	return "healthy"
}

// readyCell is a process's READY cell: blank when it did not say.
func readyCell(s serverStatus) string {
	switch {
	case s.Ready == nil:
		return ""
	case *s.Ready:
		return "ready"
	case s.ReadyReason != "":
		return "not ready: " + s.ReadyReason
	}
	return "not ready"
}

// gpuCell sums up a server's GPUs: "none", or the count and model with
// their mean utilization and the memory used of all.
func gpuCell(g *debug.GPUResponse) string {
	switch {
	case g == nil:
		return ""
	case !g.Available || len(g.Devices) == 0:
		return "none"
	}
	var used, total uint64
	var busy, busyN uint32
	for _, d := range g.Devices {
		used, total = used+d.MemoryUsedBytes, total+d.MemoryTotalBytes
		if d.UtilizationPercent != nil {
			busy, busyN = busy+*d.UtilizationPercent, busyN+1
		}
	}
	out := fmt.Sprintf("%d× %s", len(g.Devices), g.Devices[0].Name)
	if busyN > 0 {
		out += fmt.Sprintf(" %d%% busy", busy/busyN)
	}
	return out + fmt.Sprintf(" %.0f/%.0f GiB", float64(used)/(1<<30), float64(total)/(1<<30))
}

// hicacheCell sums up a rank's host tier: "off", or "on" and the host
// pool's tokens used/total ("on 1.2k/8.2k"); blank when not known.
func hicacheCell(h *rankHiCache) string {
	switch {
	case h == nil:
		return ""
	case !h.On:
		return "off"
	}
	return "on " + fmtCount(h.TokensUsed) + "/" + fmtCount(h.Tokens)
}

// fmtCount writes a count shortly: 950, 1.2k, 8k, 3.4M.
func fmtCount(n int) string {
	short := func(v float64, unit string) string {
		return strings.TrimSuffix(fmt.Sprintf("%.1f", v), ".0") + unit
	}
	switch {
	case n < 1000:
		return itoa(n)
	case n < 999_950:
		return short(float64(n)/1e3, "k")
	case n < 999_950_000:
		return short(float64(n)/1e6, "M")
	}
	return short(float64(n)/1e9, "G")
}

func tpCell(n int) string {
	if n == 0 {
		return ""
	}
	return itoa(n)
}

// fmtMS formats a duration in milliseconds for a table: milliseconds
// below a second, then tenths of seconds.
func fmtMS(ms float64) string {
	d := time.Duration(ms * float64(time.Millisecond))
	if d < time.Second {
		return d.Round(time.Millisecond).String()
	}
	return d.Round(100 * time.Millisecond).String()
}
