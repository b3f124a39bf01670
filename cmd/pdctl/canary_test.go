package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// newCanaryCluster is newCluster with room for canary prompts (2048 KV
// tokens a rank), HiCache on with bf16 index keys, and cfg's changes.
func newCanaryCluster(t *testing.T, cfg func(*serve.Config)) *cluster {
	t.Helper()
	saved := testConfig
	defer func() { testConfig = saved }()
	testConfig.KVTokens = 2048
	testConfig.IndexK = kernels.IndexBF16
	testConfig.HiCache = serve.HiCacheConfig{Enabled: true}
	if cfg != nil {
		cfg(&testConfig)
	}
	return newCluster(t)
}

// hostHits is rank 0's count of requests whose prefix loaded back from
// host on n.
func hostHits(n *node) uint64 {
	if ts := n.eng.View().HiCache(); len(ts) > 0 {
		return ts[0].Totals.HostHits
	}
	return 0
}

// canaryLine masks what varies in diagnose's report of its canaries: the
// prompt lengths.
var canaryLine = regexp.MustCompile(`prompts of [0-9–]+ tokens`)

// TestDiagnoseCanariesHealthy: a healthy cluster with HiCache on (bf16
// index keys, loads back from host paced to 16MiB/s as in the fault's
// test, so that the gates really hold readers) under a little concurrent
// load, diagnosed with 3 canaries 3 times: healthy each time, every canary
// loaded back from host on the prefill (its host hits grow by 3 a run) and
// gave the same outputs.
func TestDiagnoseCanariesHealthy(t *testing.T) {
	c := newCanaryCluster(t, nil)
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetHiCacheBandwidth(t.Context(), 16<<20); err != nil {
		t.Fatal(err)
	}
	served, stop := load(t, c.router, 4)
	waitfor.For(t, "the load served 8 completions", 20*time.Second, func() bool { return served() >= 8 })
	for run := range 3 {
		before, loadBefore := hostHits(c.prefill), served()
		code, stdout, stderr := c.pdctl(t, false, "diagnose", "--window", "1s", "--interval", "500ms", "--canaries", "3", "--canary-seed", "7")
		stderr = regexp.MustCompile(`(?m)^[0-9]+ samples over [0-9.]+m?s$`).ReplaceAllString(stderr, "* samples over *")
		stderr = canaryLine.ReplaceAllString(stderr, "prompts of * tokens")
		want := "sampling 2 servers every 500ms for 1s…\n* samples over *\n" +
			"3 canaries through ROUTER (seed 7, prompts of * tokens, 16 greedy tokens each): hicache on at PREFILL; 0 of 3 differ\n"
		if code != exitOK || stdout != "healthy\n" || stderr != want {
			t.Fatalf("run %d: exit %d\nstdout:\n%s\nstderr:\n%s\nwant:\n%s", run, code, stdout, stderr, want)
		}
		if got := hostHits(c.prefill) - before; got < 3 {
			t.Errorf("run %d: %d host hits on the prefill, want one a canary at least", run, got)
		}
		if served() == loadBefore {
			t.Errorf("run %d: no completion of the load served while diagnose ran", run)
		}
	}
	stop()

	// HiCache off everywhere: nothing loads back, stderr says so, and the
	// canaries still compare a cache hit with no_cache.
	code, stdout, stderr := c.pdctl(t, false, "hicache", "off")
	if code != exitOK {
		t.Fatalf("hicache off: exit %d\n%s%s", code, stdout, stderr)
	}
	before := hostHits(c.prefill)
	code, stdout, stderr = c.pdctl(t, false, "diagnose", "--window", "500ms", "--interval", "500ms", "--canaries", "2", "--canary-seed", "8")
	want := "2 canaries through ROUTER (seed 8, prompts of * tokens, 16 greedy tokens each): hicache is off on every server, " +
		"so nothing loads back from host: each compares a cache hit with no_cache; 0 of 2 differ\n"
	if code != exitOK || stdout != "healthy\n" || !strings.HasSuffix(canaryLine.ReplaceAllString(stderr, "prompts of * tokens"), want) {
		t.Errorf("hicache off: exit %d\nstdout:\n%s\nstderr:\n%s\nwant it to end:\n%s", code, stdout, stderr, want)
	}
	if hostHits(c.prefill) != before {
		t.Error("host hits with hicache off")
	}
}

// TestDiagnoseCanariesUsage: a negative count is a usage error; servers
// named with --server that take no request without their router cannot
// carry canaries.
func TestDiagnoseCanariesUsage(t *testing.T) {
	code, stdout, stderr := runArgs(t, "diagnose", "--canaries", "-1")
	if code != exitUsage || stdout != "" || stderr != "pdctl: --canaries must not be negative\nRun 'pdctl diagnose --help' for usage.\n" {
		t.Errorf("--canaries -1: exit %d\nstdout: %q\nstderr: %q", code, stdout, stderr)
	}
	c := newCluster(t)
	code, stdout, stderr = c.pdctl(t, false, "--server", c.prefill.ts.URL, "--server", c.decode.ts.URL, "diagnose", "--canaries", "1")
	if want := "pdctl: cannot run: --canaries needs the router or a colocated --server: a prefill or decode server takes no request without its router\n"; code != exitNoRun || stdout != "" || stderr != want {
		t.Errorf("--server PD: exit %d\nstdout: %q\nstderr: %q\nwant: %q", code, stdout, stderr, want)
	}
}

// garbleNoCache stands in front of the router and garbles the text of
// every answer to a no_cache completion, so that every canary differs from
// its reference in a way known in advance: the model and the cluster are
// real, only the difference is made up, to pin the finding's exact output.
// The real corruption (the fault hicache-indexk-ungated) is
// canary_faultrace_test.go's.
func garbleNoCache(t *testing.T, router string) string {
	t.Helper()
	u, err := url.Parse(router)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.Header.Get("X-Canary-No-Cache") == "" || resp.StatusCode != http.StatusOK {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		var r openai.CompletionResponse
		if err := json.Unmarshal(b, &r); err != nil {
			return err
		}
		r.Choices[0].Text = "GARBLED"
		b, _ = json.Marshal(r)
		resp.Body = io.NopCloser(bytes.NewReader(b))
		resp.ContentLength = int64(len(b))
		resp.Header.Set("Content-Length", itoa(len(b)))
		return nil
	}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/completions" {
			b, _ := io.ReadAll(r.Body)
			if bytes.Contains(b, []byte(`"no_cache":true`)) && bytes.Contains(b, []byte(`"max_tokens":16`)) {
				r.Header.Set("X-Canary-No-Cache", "1")
			}
			r.Body = io.NopCloser(bytes.NewReader(b))
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(ts.Close)
	return ts.URL
}

// canaryVolatile matches what varies in an output-divergence finding from
// run to run or model to model: the outputs (quoted, maybe cut), the
// prompt lengths, the tokens offloaded, how many canaries differ.
var canaryVolatile = regexp.MustCompile(`[0-9]+ prompt tokens|offloaded [0-9]+ on|(?:loaded back|first|no_cache) "(?:[^"\\]|\\.)*"(?:…)?|prompts of [0-9–]+ tokens|[0-9]+ of ([0-9]+) (canaries|differ)`)

// maskCanaries masks canaryVolatile's matches in s; keep names the outputs
// kept as they are (such as no_cache's when it is known).
func maskCanaries(s string, keep ...string) string {
	return canaryVolatile.ReplaceAllStringFunc(s, func(m string) string {
		if slices.Contains(keep, m) {
			return m
		}
		switch {
		case strings.HasSuffix(m, "prompt tokens"):
			return "* prompt tokens"
		case strings.HasPrefix(m, "offloaded"):
			return "offloaded * on"
		case strings.HasPrefix(m, "prompts of"):
			return "prompts of * tokens"
		case strings.HasSuffix(m, "canaries"), strings.HasSuffix(m, "differ"):
			sm := canaryVolatile.FindStringSubmatch(m)
			return "* of " + sm[1] + " " + sm[2]
		}
		return m[:strings.IndexByte(m, '"')] + `"*"`
	})
}

// decodeFindings decodes diagnose's JSON output and checks that it is
// written as pdctl writes JSON.
func decodeFindings(t *testing.T, stdout string) []diag.Finding {
	t.Helper()
	var findings []diag.Finding
	if err := json.Unmarshal([]byte(stdout), &findings); err != nil {
		t.Fatalf("the JSON output: %v\n%s", err, stdout)
	}
	var again bytes.Buffer
	if err := writeJSON(&again, findings); err != nil || again.String() != stdout {
		t.Errorf("the JSON output is not as pdctl writes it:\n%s", stdout)
	}
	return findings
}

// maskFindingsJSON decodes diagnose's JSON output (decodeFindings), masks
// every summary and evidence value with maskCanaries and writes it again.
func maskFindingsJSON(t *testing.T, stdout string, keep ...string) string {
	t.Helper()
	findings := decodeFindings(t, stdout)
	var again bytes.Buffer
	for i := range findings {
		findings[i].Summary = maskCanaries(findings[i].Summary, keep...)
		for j := range findings[i].Evidence {
			findings[i].Evidence[j].Value = maskCanaries(findings[i].Evidence[j].Value, keep...)
		}
	}
	writeJSON(&again, findings)
	return again.String()
}

// TestDiagnoseCanaryOutput: the exact finding of canaries that differ,
// piped, on a terminal and as JSON, with the cells of both servers (bf16,
// HiCache on, no fault on) and the remedy; only the outputs (but the
// garbled reference), prompt lengths and offloaded tokens are masked.
func TestDiagnoseCanaryOutput(t *testing.T) {
	c := newCanaryCluster(t, nil)
	c.router = garbleNoCache(t, c.router)
	const (
		garbled = `no_cache "GARBLED"`
		summary = `* of 3 canaries gave other greedy tokens from the cache than computed without it (hicache on, index-K bf16): cached KV is corrupt, outputs are garbled`
		canary  = `* prompt tokens, offloaded * on PREFILL; loaded back "*", first "*", no_cache "GARBLED"`
		prefill = `prefill, index-K bf16, hicache on, no fault on`
		decode  = `decode, index-K bf16, hicache off, no fault on`
		remedy  = `turn HiCache off on every server (pdctl hicache off) until the cause is fixed: outputs computed without the host tier are right; then run pdctl diagnose --canaries again to confirm.`
		counts  = `* of 3 differ (greedy, 16 tokens each, prompts of * tokens, seed 5)`
	)
	args := []string{"diagnose", "--window", "500ms", "--interval", "500ms", "--canaries", "3", "--canary-seed", "5"}

	code, stdout, stderr := c.pdctl(t, false, args...)
	piped := "critical\toutput-divergence\tROUTER\t-\t" + summary + "\tcanaries=" + counts +
		"; canary 0=" + canary + "; canary 1=" + canary + "; canary 2=" + canary +
		"; PREFILL=" + prefill + "; DECODE=" + decode + "; seen=*\t" + remedy + "\n"
	wantErr := "3 canaries through ROUTER (seed 5, prompts of * tokens, 16 greedy tokens each): hicache on at PREFILL; 3 of 3 differ\n" +
		"pdctl: diagnose: 1 finding (1 critical)\n"
	if got := maskCanaries(stdout, garbled); code != exitFindings || got != piped || !strings.HasSuffix(canaryLine.ReplaceAllString(stderr, "prompts of * tokens"), wantErr) {
		t.Errorf("piped: exit %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s", code, got, piped, stderr)
	}

	code, stdout, _ = c.pdctl(t, true, args...)
	tty := "critical output-divergence ROUTER: " + summary + "\n  canaries: " + counts + "\n" +
		"  canary 0: " + canary + "\n  canary 1: " + canary + "\n  canary 2: " + canary + "\n" +
		"  PREFILL: " + prefill + "\n  DECODE: " + decode + "\n  seen: *\n  remedy: " + remedy + "\n"
	if got := maskCanaries(stdout, garbled); code != exitFindings || got != tty {
		t.Errorf("terminal: exit %d\nstdout:\n%s\nwant:\n%s", code, got, tty)
	}

	code, stdout, _ = c.pdctl(t, false, append(args, "--json")...)
	q := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	wantJSON := `[
  {
    "rule": "output-divergence",
    "severity": "critical",
    "server": "ROUTER",
    "rank": null,
    "summary": ` + q(summary) + `,
    "evidence": [
      {
        "key": "canaries",
        "value": ` + q(counts) + `
      },
      {
        "key": "canary 0",
        "value": ` + q(canary) + `
      },
      {
        "key": "canary 1",
        "value": ` + q(canary) + `
      },
      {
        "key": "canary 2",
        "value": ` + q(canary) + `
      },
      {
        "key": "PREFILL",
        "value": ` + q(prefill) + `
      },
      {
        "key": "DECODE",
        "value": ` + q(decode) + `
      }
    ],
    "seen": "*",
    "remedy": ` + q(remedy) + `
  }
]
`
	if got := maskFindingsJSON(t, stdout, garbled); code != exitFindings || got != wantJSON {
		t.Errorf("JSON: exit %d\n%s\nwant:\n%s", code, got, wantJSON)
	}
}
