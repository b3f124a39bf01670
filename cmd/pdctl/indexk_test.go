package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/router"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// waitSwitches waits until n's state counts want index-K switches: the
// totals come with the engine's next published snapshot, a little after
// the switch.
func waitSwitches(t *testing.T, n *node, want uint64) {
	t.Helper()
	waitfor.For(t, "the switches counted", 10*time.Second, func() bool {
		st, err := client.New(n.ts.URL, "", nil).State(t.Context())
		return err == nil && st.Snapshot != nil && st.Snapshot.Totals.IndexKSwitches == want
	})
}

// TestIndexK shows and switches the index-K precision of live servers
// through pdctl: the PD pair behind the router (prefill first, then
// decode), again (already), as JSON, a colocated server whose model has no
// sparse indexer (skipped, or an error when it is the only one), an
// unreachable server (the decode is left as it is), and a prefill with a
// switch under way (refused, the decode left as it is; the message says
// which server runs which precision). The steps run in order.
func TestIndexK(t *testing.T) {
	c := newCluster(t)
	llama := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlama, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	plain := newNode(t, llama, serve.Config{PageSize: 4, KVTokens: 128, MaxRunning: 4}, server.Options{})
	pc := client.New(c.prefill.ts.URL, "", nil)
	var pending chan error // the prefill's switch held by its stalled rank
	steps := []struct {
		name   string
		before func()
		args   []string
		code   exitCode
		stdout string
		stderr string
	}{
		{
			name:   "status",
			args:   []string{"indexk", "status"},
			stdout: "PREFILL\tprefill\tfp8\tyes\t0\nDECODE\tdecode\tfp8\tyes\t0\n",
		},
		{
			name:   "set bf16: the prefill first",
			args:   []string{"indexk", "set", "bf16"},
			stdout: "ROUTER\trouter\t-\t-\t*\t-\tpaused: 0 requests waited\n" + "PREFILL\tprefill\tfp8\tbf16\t*\t0\tswitched\nDECODE\tdecode\tfp8\tbf16\t*\t0\tswitched\n",
		},
		{
			name:   "set bf16 again",
			args:   []string{"indexk", "set", "bf16", "--drain", "1s"},
			stdout: "ROUTER\trouter\t-\t-\t*\t-\tpaused: 0 requests waited\n" + "PREFILL\tprefill\tbf16\tbf16\t-\t0\talready\nDECODE\tdecode\tbf16\tbf16\t-\t0\talready\n",
		},
		{
			name:   "status after the switch; a server without an indexer",
			before: func() { waitSwitches(t, c.decode, 1) },
			args:   []string{"--server", c.decode.ts.URL, "--server", plain.ts.URL, "indexk", "status"},
			stdout: "DECODE\tdecode\tbf16\tyes\t1\nPLAIN\tcolocated\tn/a: no sparse indexer\tno\t0\n",
		},
		{
			name: "set fp8 as JSON; a server without an indexer is skipped",
			args: []string{"--server", c.prefill.ts.URL, "--server", c.decode.ts.URL, "--server", plain.ts.URL, "indexk", "set", "fp8", "--json"},
			stdout: `{
  "to": "fp8",
  "drain_ms": 30000,
  "servers": [
    {
      "url": "PREFILL",
      "role": "prefill",
      "result": "switched",
      "from": "bf16",
      "to": "fp8",
      "paused_ms": 0,
      "aborted": 0,
      "index_k": "fp8"
    },
    {
      "url": "PLAIN",
      "role": "colocated",
      "result": "skipped",
      "detail": "no sparse indexer",
      "paused_ms": 0,
      "aborted": 0
    },
    {
      "url": "DECODE",
      "role": "decode",
      "result": "switched",
      "from": "bf16",
      "to": "fp8",
      "paused_ms": 0,
      "aborted": 0,
      "index_k": "fp8"
    }
  ]
}
`,
		},
		{
			name:   "status as JSON",
			before: func() { waitSwitches(t, c.prefill, 2) },
			args:   []string{"--server", c.prefill.ts.URL, "--server", plain.ts.URL, "indexk", "status", "--json"},
			stdout: `{
  "servers": [
    {
      "url": "PREFILL",
      "role": "prefill",
      "index_k": "fp8",
      "indexer": true,
      "switches": 2
    },
    {
      "url": "PLAIN",
      "role": "colocated",
      "index_k": "fp8",
      "indexer": false,
      "switches": 0
    }
  ]
}
`,
		},
		{
			name:   "only servers without an indexer",
			args:   []string{"--server", plain.ts.URL, "indexk", "set", "bf16"},
			code:   exitError,
			stdout: "PLAIN\tcolocated\t-\t-\t-\t-\tskipped: no sparse indexer\n",
			stderr: "pdctl: no server's model has a sparse indexer, so none has an index-K precision to switch\n",
		},
		{
			name: "a server that cannot be reached may be a prefill: the decode is left as it is",
			args: []string{"--server", "http://127.0.0.1:1", "--server", c.decode.ts.URL, "indexk", "set", "bf16"},
			code: exitError,
			stdout: "http://127.0.0.1:1\t-\t-\t-\t-\t-\tunreachable: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\n" +
				"DECODE\tdecode\tfp8\t-\t-\t-\tskipped: left as it is: not every prefill server switched (http://127.0.0.1:1)\n",
			stderr: "pdctl: the switch to bf16 did not take on 2 servers (http://127.0.0.1:1, DECODE); the cluster may be mixed: fp8 on DECODE; unknown on http://127.0.0.1:1\n",
		},
		{
			// The prefill's last rank held: a switch started through its
			// admin API cannot finish, and another is refused.
			name: "a prefill with a switch under way refuses; the decode is left as it is",
			before: func() {
				if err := c.prefill.eng.SetFault(serve.FaultStallLastRank, true); err != nil {
					t.Fatal(err)
				}
				// The switch goes in once the stall holds: rank 1 may be
				// past the switch's check in the iteration under way, and
				// that iteration would then carry the switch to its end.
				waitfor.For(t, "the prefill's rank 0 waiting for its stalled rank 1", 10*time.Second, func() bool {
					for _, g := range c.prefill.eng.View().Collectives() {
						if g.Name == serve.CommControl && len(g.Ranks) == 2 {
							return g.Ranks[0].Waiting != nil && g.Ranks[1].Waiting == nil
						}
					}
					return false
				})
				pending = make(chan error, 1)
				go func() {
					_, err := pc.SetIndexK(context.Background(), debug.IndexKBF16, 0)
					pending <- err
				}()
				waitfor.For(t, "the prefill's switch under way", 10*time.Second, func() bool {
					var st debug.Settings
					return pc.GetJSON(t.Context(), debug.SettingsPath, &st) == nil && st.IndexKSwitch == debug.IndexKBF16
				})
			},
			args: []string{"indexk", "set", "bf16"},
			code: exitError,
			stdout: "ROUTER\trouter\t-\t-\t*\t-\tpaused: 0 requests waited\n" + "PREFILL\tprefill\tfp8\t-\t-\t-\trefused: PREFILL/admin/v1/indexk/bf16?drain=30s: 409 an index-K switch to bf16 is under way: retry once GET /debug/v1/settings shows index_k bf16\n" +
				"DECODE\tdecode\tfp8\t-\t-\t-\tskipped: left as it is: not every prefill server switched (PREFILL)\n",
			stderr: "pdctl: the switch to bf16 did not take on 2 servers (PREFILL, DECODE); the cluster may be mixed: fp8 on PREFILL, DECODE\n",
		},
		{
			name:   "status while the switch is under way",
			before: func() { waitSwitches(t, c.decode, 2) },
			args:   []string{"indexk", "status"},
			stdout: "PREFILL\tprefill\tfp8 (switching to bf16)\tyes\t2\n" +
				"DECODE\tdecode\tfp8\tyes\t2\n",
		},
		{
			// Released, the prefill finishes its switch; the decode follows.
			name: "set bf16 once the prefill has switched",
			before: func() {
				if err := c.prefill.eng.SetFault(serve.FaultStallLastRank, false); err != nil {
					t.Fatal(err)
				}
				if err := <-pending; err != nil {
					t.Fatalf("the prefill's switch: %v", err)
				}
			},
			args:   []string{"indexk", "set", "bf16"},
			stdout: "ROUTER\trouter\t-\t-\t*\t-\tpaused: 0 requests waited\n" + "PREFILL\tprefill\tbf16\tbf16\t-\t0\talready\nDECODE\tdecode\tfp8\tbf16\t*\t0\tswitched\n",
		},
		{
			name:   "no precision",
			args:   []string{"indexk", "set"},
			code:   exitUsage,
			stderr: "pdctl: indexk set takes one precision, fp8 or bf16, got []\nRun 'pdctl indexk set --help' for usage.\n",
		},
		{
			name:   "an unknown precision",
			args:   []string{"indexk", "set", "int4"},
			code:   exitUsage,
			stderr: "pdctl: indexk set takes one precision, fp8 or bf16, got [\"int4\"]\nRun 'pdctl indexk set --help' for usage.\n",
		},
		{
			name:   "a negative drain",
			args:   []string{"indexk", "set", "fp8", "--drain", "-1s"},
			code:   exitUsage,
			stderr: "pdctl: --drain -1s: want a non-negative duration\nRun 'pdctl indexk set --help' for usage.\n",
		},
		{
			name:   "no command",
			args:   []string{"indexk"},
			code:   exitUsage,
			stderr: "pdctl: indexk needs a command: status, set or ab\nRun 'pdctl indexk --help' for usage.\n",
		},
	}
	for _, st := range steps {
		if st.before != nil {
			st.before()
		}
		code, stdout, stderr := c.pdctl(t, false, st.args...)
		stdout = maskJSON(strings.ReplaceAll(stdout, plain.ts.URL, "PLAIN"), "paused_ms")
		if code != st.code || stdout != st.stdout || stderr != st.stderr {
			t.Errorf("%s: exit %d, want %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s\nwant:\n%s", st.name, code, st.code, stdout, st.stdout, stderr, st.stderr)
		}
	}

	// pdctl status has the precision per server.
	_, stdout, _ := c.pdctl(t, false, "--server", plain.ts.URL, "--server", c.decode.ts.URL, "status")
	if stdout = strings.ReplaceAll(stdout, plain.ts.URL, "PLAIN"); !strings.HasPrefix(stdout, "PLAIN\tcolocated\t1\ttiny\tn/a\thealthy\t") ||
		!strings.Contains(stdout, "\nDECODE\tdecode\t2\ttiny\tbf16\thealthy\t") {
		t.Errorf("status:\n%s", stdout)
	}
	// On a terminal: aligned, with a header, PAUSED masked.
	_, stdout, _ = c.pdctl(t, true, "indexk", "set", "fp8")
	if got := regexp.MustCompile(` {2,}`).ReplaceAllString(stdout, "  "); got != "SERVER  ROLE  FROM  TO  PAUSED  ABORTED  RESULT\n"+
		"ROUTER  router  -  -  *  -  paused: 0 requests waited\n"+
		"PREFILL  prefill  bf16  fp8  *  0  switched\nDECODE  decode  bf16  fp8  *  0  switched\n" {
		t.Errorf("terminal:\n%s", stdout)
	}
}

// TestIndexKSetUnderLoad switches a PD cluster with pdctl, back and forth,
// while clients keep sending requests through the router: the router is
// paused for each switch, so every request succeeds (none meets a prefill
// and a decode in two precisions), each output is the greedy output of its
// prompt in one of the two precisions, and once the switches are done the
// pools are back to idle. The long form (30 switches under 32 clients)
// runs with -tags redteam.
func TestIndexKSetUnderLoad(t *testing.T) { indexKSwitchesUnderLoad(t, 4, 8) }

func indexKSwitchesUnderLoad(t *testing.T, switches, clients int) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	cfg := serve.Config{TP: 2, PageSize: 4, KVTokens: 256, MaxRunning: 4, IndexK: kernels.IndexFP8,
		PD: serve.PDConfig{BootstrapTimeout: 2 * time.Second, AbortAckTimeout: 200 * time.Millisecond}}
	cc := clustertest.New(t, clustertest.Options{Model: m, Config: cfg,
		Router: router.Options{HealthInterval: 20 * time.Millisecond}, HealthyWithin: 10 * time.Second})
	c := &cluster{m: m, prefill: nodeOf(cc.Prefill), decode: nodeOf(cc.Decode), registry: cc.Registry, router: cc.Router.URL}

	const prompts = 4
	prompt := func(i int) string { return strings.Repeat("once upon a time ", 1+i%prompts) }
	// complete sends prompt i and returns the status and, on 200, the
	// choice's text and finish reason; else the body.
	complete := func(ctx context.Context, i int) (code int, text, finish string) {
		b, _ := json.Marshal(map[string]any{"prompt": prompt(i), "max_tokens": 6, "ignore_eos": true, "temperature": 0})
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.router+"/v1/completions", bytes.NewReader(b))
		if err != nil {
			return 0, err.Error(), ""
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error(), ""
		}
		defer resp.Body.Close()
		var body bytes.Buffer
		body.ReadFrom(resp.Body)
		var out struct {
			Choices []struct {
				Text         string `json:"text"`
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(body.Bytes(), &out) != nil || len(out.Choices) != 1 {
			return resp.StatusCode, body.String(), ""
		}
		return resp.StatusCode, out.Choices[0].Text, out.Choices[0].FinishReason
	}
	set := func(to string) {
		t.Helper()
		code, stdout, stderr := c.pdctl(t, false, "indexk", "set", to, "--drain", "20s")
		lines := strings.Split(strings.TrimSpace(stdout), "\n")
		if code != exitOK || stderr != "" || len(lines) != 3 || !strings.HasPrefix(lines[0], "ROUTER\trouter\t-\t-\t*\t-\tpaused: ") ||
			!strings.HasPrefix(lines[1], "PREFILL\tprefill\t") || !strings.HasSuffix(lines[1], "\tswitched") ||
			!strings.HasPrefix(lines[2], "DECODE\tdecode\t") || !strings.HasSuffix(lines[2], "\tswitched") {
			t.Fatalf("indexk set %s: exit %d\n%s\n%s", to, code, stdout, stderr)
		}
	}
	// The greedy output of every prompt in each precision, on a quiet
	// cluster.
	want := map[string][prompts]string{}
	for _, dt := range []string{debug.IndexKFP8, debug.IndexKBF16, debug.IndexKFP8} {
		if dt != debug.IndexKFP8 || len(want) > 0 {
			set(dt)
		}
		var outs [prompts]string
		for i := range prompts {
			code, text, finish := complete(t.Context(), i)
			if code != http.StatusOK || finish != "length" {
				t.Fatalf("prompt %d in %s: %d %s %s", i, dt, code, text, finish)
			}
			outs[i] = text
		}
		if prev, ok := want[dt]; ok && prev != outs {
			t.Fatalf("the outputs in %s differ between two quiet runs: %q and %q", dt, prev, outs)
		}
		want[dt] = outs
	}

	// The clients, each sending one request after the other until the
	// switches are done.
	var stop atomic.Bool
	var sent, failed, corrupt atomic.Int64
	var wg sync.WaitGroup
	for w := range clients {
		wg.Go(func() {
			for i := w; !stop.Load(); i += clients {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				code, text, finish := complete(ctx, i)
				cancel()
				sent.Add(1)
				switch {
				case code != http.StatusOK || finish != "length":
					failed.Add(1)
					t.Errorf("during the switches: %d %s (finish %q)", code, strings.TrimSpace(text), finish)
				case text != want[debug.IndexKFP8][i%prompts] && text != want[debug.IndexKBF16][i%prompts]:
					corrupt.Add(1)
					t.Errorf("prompt %d during the switches: %q, neither fp8's %q nor bf16's %q", i%prompts, text,
						want[debug.IndexKFP8][i%prompts], want[debug.IndexKBF16][i%prompts])
				}
			}
		})
	}
	to := debug.IndexKFP8
	for k := range switches {
		n := sent.Load()
		waitfor.For(t, "requests served between two switches", 30*time.Second, func() bool { return sent.Load() >= n+int64(clients) })
		to = map[string]string{debug.IndexKFP8: debug.IndexKBF16, debug.IndexKBF16: debug.IndexKFP8}[to]
		set(to)
		t.Logf("switch %d to %s done, %d requests so far", k+1, to, sent.Load())
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d switches under %d clients: %d requests, %d failed, %d corrupt", switches, clients, sent.Load(), failed.Load(), corrupt.Load())
	dt := kernels.IndexFP8
	if to == debug.IndexKBF16 {
		dt = kernels.IndexBF16
	}
	for _, n := range []*node{c.prefill, c.decode} {
		if got := n.eng.View().IndexK(); got != dt {
			t.Errorf("%s: index-K %v after the switches, want %v", n.ts.URL, got, dt)
		}
	}
	// Nothing leaked: both pools hold only cached pages once idle.
	for _, n := range []*node{c.prefill, c.decode} {
		waitfor.For(t, n.ts.URL+" idle", 20*time.Second, func() bool {
			r, err := client.New(n.ts.URL, "", nil).Requests(t.Context(), "")
			return err == nil && len(r.Requests) == 0 && r.Pending == 0 &&
				!slices.ContainsFunc(r.KV, func(kv debug.KVPages) bool { return kv.Held() != 0 })
		})
	}
	total := uint64(2 + switches)
	waitSwitches(t, c.prefill, total)
	waitSwitches(t, c.decode, total)
}
