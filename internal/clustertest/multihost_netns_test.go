//go:build netns

// The multi-host test: router, prefill and decode as real pdserve
// processes, each in its own network namespace with its own address on a
// bridge, so that nothing reaches a peer over loopback. It needs root and
// iproute2:
//
//	go test -tags netns -run TestMultiHost ./internal/clustertest/
package clustertest_test

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// Fixed ports are safe: each server has a namespace of its own.
const (
	routerPort    = 8000
	prefillPort   = 30000
	bootstrapPort = 8998
	decodePort    = 30001
)

// prompts are the greedy requests compared with the colocated run.
var prompts = []string{
	"Once upon a time",
	"The capital of France is",
	"1, 2, 3, 4,",
	"A long prompt that spans more than one page of the KV cache, so that the transfer carries several pages across the bridge",
}

func TestMultiHost(t *testing.T) {
	requireNetns(t)
	dir := t.TempDir()
	pdserve, pdctl := buildTools(t, dir)
	model := tinyModel(t, pdserve, dir)
	env := append(os.Environ(), "PD_CLUSTER_SECRET="+rand.Text())

	lan := newBridgeNet(t)
	routerNS, prefillNS, decodeNS := lan.addHost(t, "router"), lan.addHost(t, "prefill"), lan.addHost(t, "decode")

	// A PD server bound to every address refuses to start without an
	// address to advertise.
	if out, err := exec.Command("ip", "netns", "exec", prefillNS.name, pdserve, "prefill", "--model", model,
		"--host", "0.0.0.0", "--port", "0", "--bootstrap-port", "0").CombinedOutput(); exitCode(err) != 2 || !bytes.Contains(out, []byte("--advertise-host")) {
		t.Errorf("prefill on 0.0.0.0 without --advertise-host: %v\n%s\nwant exit 2 naming --advertise-host", err, out)
	}

	ref := startProc(t, "serve", "", env, pdserve, "serve", "--model", model, "--port", "0")
	refURL := ref.waitLog(t, `serving \S+ \(colocated\) on (http://\S+)`)
	want := completeAll(t, refURL, prompts)

	prefillArgs := []string{"prefill", "--model", model, "--host", "0.0.0.0", "--pd-host", "0.0.0.0",
		"--advertise-host", prefillNS.addr, "--port", fmt.Sprint(prefillPort), "--bootstrap-port", fmt.Sprint(bootstrapPort)}
	prefill := startProc(t, "prefill", prefillNS.name, env, pdserve, prefillArgs...)
	// The decode takes requests only for the prefill's registry; set
	// through its variable (--prefill-bootstrap).
	decodeEnv := append(env[:len(env):len(env)], "PD_PREFILL_BOOTSTRAP="+hostURL(prefillNS.addr, bootstrapPort))
	startProc(t, "decode", decodeNS.name, decodeEnv, pdserve, "decode", "--model", model, "--host", "0.0.0.0", "--pd-host", "0.0.0.0",
		"--advertise-host", decodeNS.addr, "--port", fmt.Sprint(decodePort))
	startProc(t, "router", routerNS.name, env, pdserve, "router", "--host", routerNS.addr, "--port", fmt.Sprint(routerPort),
		"--prefill", hostURL(prefillNS.addr, prefillPort), "--decode", hostURL(decodeNS.addr, decodePort))
	router := hostURL(routerNS.addr, routerPort)
	waitHealthy(t, router+"/health", time.Minute)

	checkAdvertised(t, prefill, prefillNS.addr)
	checkOutputs(t, "through the router", completeAll(t, router, prompts), want)

	drill := exec.Command(pdctl, "abort", "--sessions", "12", "--router", router)
	drill.Env = env
	out, err := drill.CombinedOutput()
	if err != nil {
		t.Errorf("pdctl abort --sessions 12: %v\n%s", err, out)
	}
	t.Logf("pdctl abort --sessions 12:\n%s", out)
	checkOutputs(t, "after the mass-abort drill", completeAll(t, router, prompts), want)

	prefill.kill(t)
	prefill = startProc(t, "prefill (restarted)", prefillNS.name, env, pdserve, prefillArgs...)
	waitServed(t, router, prompts[0], want[0], time.Minute)
	checkAdvertised(t, prefill, prefillNS.addr)
	checkOutputs(t, "after the prefill's restart", completeAll(t, router, prompts), want)
}

// requireNetns skips the test where namespaces cannot be made.
func requireNetns(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the multi-host test makes network namespaces and a bridge: it needs root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("the multi-host test needs the ip command (iproute2)")
	}
	probe := fmt.Sprintf("pdkit-%d-probe", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", probe).CombinedOutput(); err != nil {
		t.Skipf("the multi-host test cannot make a network namespace here (a container without CAP_NET_ADMIN?): %v: %s", err, out)
	}
	ip(t, "netns", "del", probe)
}

// bridgeNet is a bridge in this namespace, with the first address of its
// subnet, and the hosts plugged into it, each a namespace with a veth.
type bridgeNet struct {
	bridge string
	subnet string // "10.231.N."
	hosts  int
}

// host is one namespace on the bridge.
type host struct{ name, addr string }

// newBridgeNet makes the bridge, its name and subnet from the process id
// so that two runs do not collide, and removes it when the test ends.
func newBridgeNet(t *testing.T) *bridgeNet {
	pid := os.Getpid()
	return makeBridge(t, fmt.Sprintf("pdbr%d", pid%100000), fmt.Sprintf("10.231.%d.", 1+pid%250))
}

// makeBridge makes bridge with the first address of subnet ("10.N.M.")
// and removes it when the test ends.
func makeBridge(t *testing.T, bridge, subnet string) *bridgeNet {
	n := &bridgeNet{bridge: bridge, subnet: subnet}
	t.Cleanup(func() { ip(nil, "link", "del", n.bridge) })
	ip(t, "link", "add", n.bridge, "type", "bridge")
	ip(t, "addr", "add", n.subnet+"1/24", "dev", n.bridge)
	ip(t, "link", "set", n.bridge, "up")
	return n
}

// addHost makes a namespace with the next address, plugged into the
// bridge, and deletes it (its veth with it) when the test ends.
func (n *bridgeNet) addHost(t *testing.T, role string) host {
	n.hosts++
	h := host{name: fmt.Sprintf("pdkit-%d-%s", os.Getpid(), role), addr: fmt.Sprintf("%s%d", n.subnet, 1+n.hosts)}
	veth := fmt.Sprintf("pv%d%c", os.Getpid()%100000, 'a'+n.hosts)
	t.Cleanup(func() { ip(nil, "netns", "del", h.name) })
	ip(t, "netns", "add", h.name)
	ip(t, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
	ip(t, "link", "set", veth, "master", n.bridge)
	ip(t, "link", "set", veth, "up")
	ip(t, "-n", h.name, "addr", "add", h.addr+"/24", "dev", "eth0")
	ip(t, "-n", h.name, "link", "set", "eth0", "up")
	ip(t, "-n", h.name, "link", "set", "lo", "up")
	return h
}

// ip runs the ip command; a failure fails t (nil: ignored, for teardown).
func ip(t *testing.T, args ...string) {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil && t != nil {
		t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// proc is a pdserve child process, its output kept for the failure report.
type proc struct {
	name string
	cmd  *exec.Cmd
	out  *syncbuf.Buffer
	done chan struct{}
	err  error
}

// startProc runs bin in namespace ns ("": this one) and stops it when the
// test ends: SIGTERM, then SIGKILL after 15 s.
func startProc(t *testing.T, name, ns string, env []string, bin string, args ...string) *proc {
	t.Helper()
	if ns != "" {
		args = append([]string{"netns", "exec", ns, bin}, args...)
		bin = "ip"
	}
	p := &proc{name: name, cmd: exec.Command(bin, args...), out: &syncbuf.Buffer{}, done: make(chan struct{})}
	p.cmd.Env, p.cmd.Stdout, p.cmd.Stderr = env, p.out, p.out
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { p.stop(t) })
	return p
}

// stop ends p, and reports its output when the test failed.
func (p *proc) stop(t *testing.T) {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
	if t.Failed() {
		t.Logf("%s output (last 3000 bytes):\n%s", p.name, tail(p.out.String(), 3000))
	}
}

// kill ends p at once, as a crash would.
func (p *proc) kill(t *testing.T) {
	p.cmd.Process.Kill()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not die within 10s of SIGKILL", p.name)
	}
}

// waitLog waits up to a minute for p's output to match re and returns its
// first group.
func (p *proc) waitLog(t *testing.T, re string) string {
	t.Helper()
	rx := regexp.MustCompile(re)
	var m []string
	logged := waitfor.Poll(time.Minute, func() bool {
		select {
		case <-p.done:
			t.Fatalf("%s exited (%v) before logging %q:\n%s", p.name, p.err, re, p.out.String())
		default:
		}
		m = rx.FindStringSubmatch(p.out.String())
		return m != nil
	})
	if !logged {
		t.Fatalf("%s logged no %q within a minute:\n%s", p.name, re, p.out.String())
	}
	return m[1]
}

// checkAdvertised checks that the prefill advertises addr, never a
// wildcard or loopback: in its log, its /pd/v1/info and its registered
// ZeroMQ endpoints.
func checkAdvertised(t *testing.T, prefill *proc, addr string) {
	t.Helper()
	bootstrap := hostURL(addr, bootstrapPort)
	prefill.waitLog(t, `bootstrap registry on (`+regexp.QuoteMeta(bootstrap)+`)\n`)
	prefill.waitLog(t, `serving \S+ \(prefill\) on (`+regexp.QuoteMeta(hostURL(addr, prefillPort))+`)\n`)
	var info pdproto.ServerInfo
	getJSON(t, hostURL(addr, prefillPort)+pdproto.InfoPath, &info)
	if info.BootstrapURL != bootstrap {
		t.Errorf("prefill /pd/v1/info bootstrap_url %q; want %q", info.BootstrapURL, bootstrap)
	}
	var ranks pdproto.LookupResponse
	getJSON(t, bootstrap+pdproto.BootstrapRanksPath, &ranks)
	for _, r := range ranks.Ranks {
		if !strings.HasPrefix(r.Endpoint, "tcp://"+addr+":") {
			t.Errorf("prefill rank %d registered endpoint %q; want tcp://%s:PORT", r.Rank, r.Endpoint, addr)
		}
	}
	if len(ranks.Ranks) == 0 {
		t.Error("the prefill's registry lists no ranks")
	}
}

// completion is what the test reads of a /v1/completions answer.
type completion struct {
	Choices []struct {
		Text string `json:"text"`
	} `json:"choices"`
}

// complete sends one greedy completion to base.
func complete(base, prompt string) (string, error) {
	body, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 16, "temperature": 0})
	c := http.Client{Timeout: 30 * time.Second}
	resp, err := c.Post(base+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", resp.Status, b)
	}
	var cm completion
	if err := json.Unmarshal(b, &cm); err != nil || len(cm.Choices) != 1 {
		return "", fmt.Errorf("bad completion %s: %v", b, err)
	}
	return cm.Choices[0].Text, nil
}

// completeAll sends every prompt to base, one after another.
func completeAll(t *testing.T, base string, prompts []string) []string {
	t.Helper()
	out := make([]string, len(prompts))
	for i, p := range prompts {
		text, err := complete(base, p)
		if err != nil {
			t.Fatalf("completion %q on %s: %v", p, base, err)
		}
		out[i] = text
	}
	return out
}

func checkOutputs(t *testing.T, when string, got, want []string) {
	t.Helper()
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("%s: prompt %q gave %q; the colocated server gave %q", when, prompts[i], got[i], want[i])
		}
	}
}

// waitServed sends prompt to base until its answer is want.
func waitServed(t *testing.T, base, prompt, want string, within time.Duration) {
	t.Helper()
	waitfor.NoError(t, base+" serving a request", within, func() error {
		got, err := complete(base, prompt)
		if err == nil && got != want {
			err = fmt.Errorf("answered %q; want %q", got, want)
		}
		return err
	})
}

// waitHealthy polls url until it answers 200.
func waitHealthy(t *testing.T, url string, within time.Duration) {
	t.Helper()
	c := http.Client{Timeout: 2 * time.Second}
	waitfor.NoError(t, url+" healthy", within, func() error {
		resp, err := c.Get(url)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return errors.New(resp.Status)
		}
		return nil
	})
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s: %s", url, resp.Status, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("GET %s: %v: %s", url, err, b)
	}
}

func hostURL(addr string, port int) string { return fmt.Sprintf("http://%s:%d", addr, port) }

func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// tinyModel writes the tiny built-in model into dir with pdserve model
// init, as an operator would, and returns its path.
func tinyModel(t *testing.T, pdserve, dir string) string {
	t.Helper()
	model := filepath.Join(dir, "tiny.gguf")
	if out, err := exec.Command(pdserve, "model", "init", "--arch", "llama", "--size", "tiny", "-o", model).CombinedOutput(); err != nil {
		t.Fatalf("pdserve model init: %v\n%s", err, out)
	}
	return model
}

// buildTools builds pdserve and pdctl from this module into dir.
func buildTools(t *testing.T, dir string) (pdserve, pdctl string) {
	t.Helper()
	cmd := exec.Command("go", "build", "-o", dir+string(filepath.Separator), "./cmd/pdserve", "./cmd/pdctl")
	cmd.Dir = "../.."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pdserve ./cmd/pdctl: %v\n%s", err, out)
	}
	return filepath.Join(dir, "pdserve"), filepath.Join(dir, "pdctl")
}
