//go:build netns

package clustertest_test

import (
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestDiagnoseNetworkFaults makes the network faults no fault switch
// makes, on real processes in namespaces, and checks that pdctl diagnose
// names each: a thinned PD link (tc tbf), a PD link cut both ways and one
// way (blackhole routes), and a prefill that restarts on new ports. The
// servers have two networks: one the router and pdctl reach them on, and
// one for the PD link alone, so that a fault on the PD link leaves their
// HTTP answering, as a partition between two hosts does. It needs root,
// iproute2 and tc's tbf qdisc:
//
//	go test -tags netns -run TestDiagnoseNetworkFaults -v ./internal/clustertest/
//
// Each scenario logs the first line of the finding and the time from the
// fault to diagnose naming it.
func TestDiagnoseNetworkFaults(t *testing.T) {
	requireNetns(t)
	requireTBF(t)
	dir := t.TempDir()
	pdserve, pdctl := buildTools(t, dir)
	model := tinyModel(t, pdserve, dir)
	env := append(os.Environ(), "PD_CLUSTER_SECRET="+rand.Text(), "XDG_CACHE_HOME="+dir)

	control := newBridgeNet(t)
	routerNS, prefillNS, decodeNS := control.addHost(t, "router"), control.addHost(t, "prefill"), control.addHost(t, "decode")
	pdNet := newBridgeNetNamed(t, "pdlk", 7)
	prefillPD, decodePD := pdNet.addNIC(t, prefillNS), pdNet.addNIC(t, decodeNS)

	prefillArgs := []string{"prefill", "--model", model, "--host", "0.0.0.0", "--pd-host", "0.0.0.0",
		"--advertise-host", prefillPD, "--port", fmt.Sprint(prefillPort), "--bootstrap-port", fmt.Sprint(bootstrapPort)}
	prefill := startProc(t, "prefill", prefillNS.name, env, pdserve, prefillArgs...)
	decodeEnv := append(env[:len(env):len(env)], "PD_PREFILL_BOOTSTRAP="+hostURL(prefillPD, bootstrapPort))
	startProc(t, "decode", decodeNS.name, decodeEnv, pdserve, "decode", "--model", model, "--host", "0.0.0.0", "--pd-host", "0.0.0.0",
		"--advertise-host", decodePD, "--port", fmt.Sprint(decodePort))
	startProc(t, "router", routerNS.name, env, pdserve, "router", "--host", routerNS.addr, "--port", fmt.Sprint(routerPort),
		"--prefill", hostURL(prefillNS.addr, prefillPort), "--decode", hostURL(decodeNS.addr, decodePort))
	router := hostURL(routerNS.addr, routerPort)
	waitHealthy(t, router+"/health", time.Minute)
	want, err := complete(router, prompts[0])
	if err != nil {
		t.Fatal(err)
	}

	diagnose := func(t *testing.T) (int, string) {
		t.Helper()
		cmd := exec.Command(pdctl, "--router", router, "diagnose", "--window", "3s", "--interval", "500ms")
		cmd.Env = env
		out, err := cmd.Output()
		return exitCode(err), string(out)
	}
	// named runs diagnose until a finding's line has every part of want,
	// and logs it with the time since the fault.
	named := func(t *testing.T, fault time.Time, want ...string) {
		t.Helper()
		var last string
		for range 4 {
			code, out := diagnose(t)
			last = fmt.Sprintf("exit %d\n%s", code, out)
			for _, l := range strings.Split(out, "\n") {
				if containsAll(l, want) && code == 1 {
					t.Logf("named in %v: %s", time.Since(fault).Round(100*time.Millisecond), firstFields(l))
					return
				}
			}
		}
		t.Fatalf("diagnose never named %q:\n%s", want, last)
	}
	long := strings.Repeat("hello world ", 40)
	send := func(n int, prefix string) (wait func() []error) {
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Go(func() { _, errs[i] = complete(router, fmt.Sprintf("%s %d %s", prefix, i, long)) })
		}
		return func() []error { wg.Wait(); return errs }
	}
	heal := func(t *testing.T) {
		t.Helper()
		waitServed(t, router, prompts[0], want, time.Minute)
	}

	if code, out := diagnose(t); code != 0 || out != "healthy\n" {
		t.Fatalf("before any fault: exit %d\n%s", code, out)
	}

	t.Run("thinned link", func(t *testing.T) {
		tc(t, prefillNS.name, "qdisc", "add", "dev", "eth1", "root", "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "5s")
		fault := time.Now()
		done := send(6, "thin")
		named(t, fault, "pd-link-slow", "slow or lossy")
		for i, err := range done() {
			if err != nil {
				t.Errorf("request %d over the thinned link failed: %v (its KV is a word from the prefill: busy is not dead)", i, err)
			}
		}
		tc(t, prefillNS.name, "qdisc", "del", "dev", "eth1", "root")
		heal(t)
	})

	// cut drops the PD packets each route names (namespace, then the
	// address it can no longer reach), sends requests over the cut link,
	// checks that diagnose names a cut link, and mends it.
	type route struct{ ns, to string }
	cut := func(t *testing.T, name string, routes ...route) {
		for _, r := range routes {
			ip(t, "-n", r.ns, "route", "add", "blackhole", r.to+"/32")
		}
		fault := time.Now()
		done := send(4, name)
		named(t, fault, "peer-unreachable", "is cut")
		done()
		for _, r := range routes {
			ip(t, "-n", r.ns, "route", "del", "blackhole", r.to+"/32")
		}
		heal(t)
	}
	t.Run("cut both ways", func(t *testing.T) {
		cut(t, "cut", route{prefillNS.name, decodePD}, route{decodeNS.name, prefillPD})
	})
	t.Run("cut one way", func(t *testing.T) {
		// The prefill's packets to the decode are lost; the decode's
		// reach the prefill.
		cut(t, "oneway", route{prefillNS.name, decodePD})
	})

	t.Run("prefill restarted", func(t *testing.T) {
		done := send(4, "restart")
		prefill.kill(t)
		fault := time.Now()
		prefill = startProc(t, "prefill (restarted)", prefillNS.name, env, pdserve, prefillArgs...)
		done()
		named(t, fault, "peer-unreachable", "restarted")
		heal(t)
	})
}

// requireTBF skips the test where tc cannot add a tbf qdisc.
func requireTBF(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("tc"); err != nil {
		t.Skip("the network-fault test thins a link with tc (iproute2)")
	}
	probe := fmt.Sprintf("pdkit-%d-tbf", os.Getpid())
	ip(t, "netns", "add", probe)
	defer ip(nil, "netns", "del", probe)
	if out, err := exec.Command("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "1s").CombinedOutput(); err != nil {
		t.Skipf("tc cannot add a tbf qdisc here (no sch_tbf?): %v: %s", err, out)
	}
}

// tc runs tc in namespace ns.
func tc(t *testing.T, ns string, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", append([]string{"netns", "exec", ns, "tc"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("tc %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// newBridgeNetNamed is newBridgeNet for a second network: prefix and
// third octet keep it apart from the first.
func newBridgeNetNamed(t *testing.T, prefix string, octet int) *bridgeNet {
	pid := os.Getpid()
	return makeBridge(t, fmt.Sprintf("%s%d", prefix, pid%10000), fmt.Sprintf("10.%d.%d.", 232+octet%20, 1+pid%250))
}

// addNIC plugs host h into the network as its eth1 and returns its address
// there; the veth goes with h's namespace.
func (n *bridgeNet) addNIC(t *testing.T, h host) string {
	n.hosts++
	addr := fmt.Sprintf("%s%d", n.subnet, 1+n.hosts)
	veth := fmt.Sprintf("%s%c", n.bridge, 'a'+n.hosts)
	ip(t, "link", "add", veth, "type", "veth", "peer", "name", "eth1", "netns", h.name)
	ip(t, "link", "set", veth, "master", n.bridge)
	ip(t, "link", "set", veth, "up")
	ip(t, "-n", h.name, "addr", "add", addr+"/24", "dev", "eth1")
	ip(t, "-n", h.name, "link", "set", "eth1", "up")
	return addr
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}

// firstFields is a finding's line as pdctl prints it off a terminal, its
// severity, rule, server, rank and summary (the tab-separated fields
// before the evidence).
func firstFields(line string) string {
	f := strings.Split(line, "\t")
	return strings.Join(f[:min(len(f), 5)], " ")
}
