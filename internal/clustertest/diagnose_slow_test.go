//go:build netns

package clustertest_test

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestDiagnoseStarvedDecode starves a running decode server of CPU the
// way a crowded host or a tight container limit does, with a cgroup CPU
// quota (5% of a core), and checks that pdctl diagnose names it slow
// (server-slow, against its own baseline at the same batch size) with its
// cgroup's throttling as the evidence, while the same sequential load
// before the quota raised nothing. It needs root and a writable cgroup
// CPU controller (v1 cpu, or v2 with cpu.max); it runs with the netns
// tests:
//
//	go test -tags netns -run TestDiagnoseStarvedDecode -v ./internal/clustertest/
func TestDiagnoseStarvedDecode(t *testing.T) {
	group := newCPUGroup(t)
	dir := t.TempDir()
	pdserve, pdctl := buildTools(t, dir)
	model := tinyModel(t, pdserve, dir)
	env := append(os.Environ(), "PD_CLUSTER_SECRET="+rand.Text(), "XDG_CACHE_HOME="+dir)
	prefill := startProc(t, "prefill", "", env, pdserve, "prefill", "--model", model, "--port", "0", "--bootstrap-port", "0")
	prefillURL := prefill.waitLog(t, `serving \S+ \(prefill\) on (http://\S+)`)
	bootstrap := prefill.waitLog(t, `bootstrap registry on (http://\S+)`)
	decode := startProc(t, "decode", "", append(env[:len(env):len(env)], "PD_PREFILL_BOOTSTRAP="+bootstrap), pdserve,
		"decode", "--model", model, "--port", "0")
	decodeURL := decode.waitLog(t, `serving \S+ \(decode\) on (http://\S+)`)
	rt := startProc(t, "router", "", env, pdserve, "router", "--port", "0", "--prefill", prefillURL, "--decode", decodeURL)
	router := rt.waitLog(t, `routing on (http://\S+)`)
	waitHealthy(t, router+"/health", time.Minute)

	diagnose := func() (int, string) {
		cmd := exec.Command(pdctl, "--router", router, "diagnose", "--window", "3s", "--interval", "500ms")
		cmd.Env = env
		out, err := cmd.Output()
		return exitCode(err), string(out)
	}
	// load sends one streaming request after another until stop, and
	// tallies time to first token and tokens per second.
	load := func() (stop func() figures) {
		quit := make(chan struct{})
		var wg sync.WaitGroup
		var f figures
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-quit:
					return
				default:
				}
				ttft, tokens, took, err := stream(router, fmt.Sprintf("request %d of a sequential load", i), 48)
				if err != nil {
					f.errors++
					continue
				}
				f.add(ttft, tokens, took)
			}
		})
		return func() figures { close(quit); wg.Wait(); return f }
	}

	stop := load()
	waitSteps(t, decodeURL, 400)
	code, out := diagnose()
	healthy := stop()
	if code != 0 || out != "healthy\n" {
		t.Fatalf("the decode under sequential load before the quota: exit %d\n%s", code, out)
	}

	group.limit(t, 5000, 100000)
	group.add(t, decode.cmd.Process.Pid)
	fault := time.Now()
	stop = load()
	var named string
	for range 6 {
		code, out = diagnose()
		for _, l := range strings.Split(out, "\n") {
			if code == 1 && strings.Contains(l, "server-slow") && strings.Contains(l, decodeURL) {
				named = l
			}
		}
		if named != "" {
			break
		}
	}
	starved := stop()
	if named == "" {
		var steps map[string]any
		getJSON(t, decodeURL+"/debug/v1/steps", &steps)
		b, _ := json.Marshal(map[string]any{"rates": steps["rates"], "process": steps["process"]})
		t.Fatalf("diagnose never named the starved decode server-slow (%s; before: %s):\n%s\nthe decode's steps: %s", starved, healthy, out, b)
	}
	t.Logf("named in %v: %s", time.Since(fault).Round(100*time.Millisecond), firstFields(named))
	if !strings.Contains(named, "throttled in") || !strings.Contains(named, "cgroup CPU quota") {
		t.Errorf("the finding does not give the cgroup's throttling as the evidence and remedy:\n%s", named)
	}
	t.Logf("before the quota: %s; under it: %s", healthy, starved)
}

// figures tallies a sequential load's requests.
type figures struct {
	n, errors  int
	ttft, took time.Duration
	tokens     int
}

func (f *figures) add(ttft time.Duration, tokens int, took time.Duration) {
	f.n++
	f.ttft += ttft
	f.took += took
	f.tokens += tokens
}

func (f figures) String() string {
	if f.n == 0 {
		return fmt.Sprintf("no request finished (%d failed)", f.errors)
	}
	return fmt.Sprintf("%d requests (%d failed), mean TTFT %v, %.0f tokens/s", f.n, f.errors,
		(f.ttft / time.Duration(f.n)).Round(time.Millisecond), float64(f.tokens)/f.took.Seconds())
}

// stream sends one greedy streaming completion of n tokens and returns its
// time to first token, the tokens it streamed and its whole time.
func stream(base, prompt string, n int) (ttft time.Duration, tokens int, took time.Duration, err error) {
	body, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true, "ignore_eos": true})
	c := http.Client{Timeout: 2 * time.Minute}
	start := time.Now()
	resp, err := c.Post(base+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return 0, 0, 0, fmt.Errorf("%s: %s", resp.Status, b)
	}
	buf := make([]byte, 4096)
	for {
		k, rerr := resp.Body.Read(buf)
		if k > 0 {
			if tokens == 0 {
				ttft = time.Since(start)
			}
			tokens += bytes.Count(buf[:k], []byte("\"text\""))
		}
		if rerr == io.EOF {
			return ttft, tokens, time.Since(start), nil
		}
		if rerr != nil {
			return 0, 0, 0, rerr
		}
	}
}

// waitSteps waits until the server at url has run n decode steps of one
// bucket, so that its baseline is set.
func waitSteps(t *testing.T, url string, n uint64) {
	t.Helper()
	type rate struct {
		Phase string `json:"phase"`
		Steps uint64 `json:"steps"`
	}
	var rates []rate
	if !waitfor.Poll(2*time.Minute, func() bool {
		var steps struct {
			Rates []rate `json:"rates"`
		}
		getJSON(t, url+"/debug/v1/steps", &steps)
		rates = steps.Rates
		return slices.ContainsFunc(rates, func(r rate) bool { return r.Phase == "decode" && r.Steps >= n })
	}) {
		t.Fatalf("%s ran fewer than %d decode steps of one bucket within 2 minutes: %+v", url, n, rates)
	}
}

// cpuGroup is a cgroup of the CPU controller made for the test, removed
// when it ends (its processes moved back to the root first).
type cpuGroup struct {
	dir string
	v2  bool
}

// newCPUGroup makes the cgroup, or skips the test where it cannot.
func newCPUGroup(t *testing.T) *cpuGroup {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the starved-decode test makes a cgroup: it needs root")
	}
	name := fmt.Sprintf("pdkit-slow-%d", os.Getpid())
	var g *cpuGroup
	switch {
	case fileExists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
		g = &cpuGroup{dir: filepath.Join("/sys/fs/cgroup/cpu", name)}
	case strings.Contains(readFile("/sys/fs/cgroup/cgroup.subtree_control"), "cpu"):
		g = &cpuGroup{dir: filepath.Join("/sys/fs/cgroup", name), v2: true}
	default:
		t.Skip("no writable cgroup CPU controller here (v1 cpu, or v2 with cpu in the root's subtree_control)")
	}
	if err := os.Mkdir(g.dir, 0o755); err != nil {
		t.Skipf("cannot make a cgroup: %v", err)
	}
	t.Cleanup(func() {
		root := filepath.Dir(g.dir)
		for _, pid := range strings.Fields(readFile(filepath.Join(g.dir, "cgroup.procs"))) {
			os.WriteFile(filepath.Join(root, "cgroup.procs"), []byte(pid), 0)
		}
		os.Remove(g.dir)
	})
	return g
}

// limit gives the group quota microseconds of CPU every period.
func (g *cpuGroup) limit(t *testing.T, quota, period int) {
	t.Helper()
	if g.v2 {
		g.write(t, "cpu.max", fmt.Sprintf("%d %d", quota, period))
		return
	}
	g.write(t, "cpu.cfs_period_us", fmt.Sprint(period))
	g.write(t, "cpu.cfs_quota_us", fmt.Sprint(quota))
}

// add moves process pid, every thread of it, into the group.
func (g *cpuGroup) add(t *testing.T, pid int) { g.write(t, "cgroup.procs", fmt.Sprint(pid)) }

func (g *cpuGroup) write(t *testing.T, file, value string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(g.dir, file), []byte(value), 0); err != nil {
		t.Fatalf("cgroup %s: %v", file, err)
	}
}

func fileExists(path string) bool { _, err := os.Stat(path); return err == nil }

func readFile(path string) string { b, _ := os.ReadFile(path); return string(b) }
