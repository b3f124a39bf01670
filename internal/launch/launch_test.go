package launch

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// The test binary is also the children: with childEnv set it runs the
// mode named there instead of the tests.
const (
	childEnv      = "PDKIT_LAUNCH_TEST_CHILD"
	portEnv       = "PDKIT_LAUNCH_TEST_PORT"
	grandchildEnv = "PDKIT_LAUNCH_TEST_GRANDCHILD" // serve: start one more process in the group, in this mode
	stubbornEnv   = "PDKIT_LAUNCH_TEST_STUBBORN"   // ignore SIGTERM
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(runChild(mode))
	}
	os.Exit(m.Run())
}

func runChild(mode string) int {
	if os.Getenv(stubbornEnv) != "" {
		signal.Ignore(syscall.SIGTERM)
	}
	switch mode {
	case "exit":
		fmt.Fprintln(os.Stderr, "about to fail")
		return 3
	case "addrinuse":
		fmt.Fprintln(os.Stderr, "listen tcp 127.0.0.1:1: bind: address already in use")
		return 1
	case "sleep":
		// The child stands for a server that never exits on its own, until
		// the test stops it: it waits on nothing, and a bare select would
		// trip the runtime's deadlock check.
		time.Sleep(time.Hour)
		return 0
	case "serve":
	default:
		fmt.Fprintln(os.Stderr, "unknown mode", mode)
		return 2
	}
	fmt.Printf("pid %d\n", os.Getpid())
	if g := os.Getenv(grandchildEnv); g != "" {
		exe, _ := os.Executable()
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), childEnv+"="+g, raceEnv)
		if err := cmd.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("grandchild pid %d\n", cmd.Process.Pid)
	}
	term := make(chan os.Signal, 1)
	if os.Getenv(stubbornEnv) == "" {
		signal.Notify(term, syscall.SIGTERM)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+os.Getenv(portEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("/die", func(http.ResponseWriter, *http.Request) {
		fmt.Fprintln(os.Stderr, "dying as asked")
		os.Exit(4)
	})
	go http.Serve(ln, mux)
	fmt.Println("stdout hello")
	fmt.Fprintln(os.Stderr, "stderr hello")
	<-term
	fmt.Fprintln(os.Stderr, "got SIGTERM")
	return 0
}

// waitMatch polls out until re matches, and returns the submatches.
func waitMatch(t *testing.T, out *syncbuf.Buffer, re string) []string {
	t.Helper()
	r := regexp.MustCompile(re)
	var m []string
	waitfor.NoError(t, fmt.Sprintf("output matching %q", re), 5*time.Second, func() error {
		s := out.String()
		if m = r.FindStringSubmatch(s); m == nil {
			return fmt.Errorf("output so far:\n%s", s)
		}
		return nil
	})
	return m
}

func testSpec(t *testing.T, name, mode string, env ...string) Spec {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ports, err := FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	p := strconv.Itoa(ports[0])
	return Spec{Name: name, Role: "test", Path: exe,
		Env:       append(os.Environ(), append([]string{childEnv + "=" + mode, portEnv + "=" + p, raceEnv}, env...)...),
		HealthURL: "http://127.0.0.1:" + p + "/health"}
}

// raceEnv keeps a child built with -race from sleeping a second on exit.
const raceEnv = "GORACE=atexit_sleep_ms=0"

func testOptions(out *syncbuf.Buffer) Options {
	return Options{Output: out, ReadyTimeout: 10 * time.Second, Grace: 5 * time.Second, PollInterval: 10 * time.Millisecond}
}

// gone reports whether pid no longer runs: no such process, or a zombie
// left for init to reap (a process orphaned by a killed group).
func gone(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return true
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return errors.Is(err, os.ErrNotExist)
	}
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] == 'Z'
}

func mustGone(t *testing.T, what string, pid int) {
	t.Helper()
	if !gone(pid) {
		t.Errorf("%s (pid %d) still runs", what, pid)
	}
}

func TestAllReadyThenCancelStopsAndReapsEveryone(t *testing.T) {
	out := &syncbuf.Buffer{}
	specs := []Spec{
		testSpec(t, "a", "serve", grandchildEnv+"=sleep"),
		testSpec(t, "bb", "serve"),
		testSpec(t, "c", "serve"),
	}
	c, err := Start(t.Context(), specs, testOptions(out))
	if err != nil {
		t.Fatal(err)
	}
	kids := c.Children()
	if len(kids) != 3 || kids[1].Name != "bb" || kids[1].Pid <= 0 {
		t.Fatalf("children %+v", kids)
	}
	// Lines are prefixed with the child's name, padded to the longest.
	waitMatch(t, out, `(?m)^a      \| stdout hello$`)
	waitMatch(t, out, `(?m)^bb     \| stderr hello$`)
	gc, _ := strconv.Atoi(waitMatch(t, out, `(?m)^a      \| grandchild pid (\d+)$`)[1])
	if gone(gc) {
		t.Fatal("grandchild not running")
	}

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v\n%s", err, out)
	}
	for _, k := range kids {
		if err := syscall.Kill(k.Pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) not reaped: kill 0 = %v", k.Name, k.Pid, err)
		}
	}
	mustGone(t, "grandchild", gc)
	s := out.String()
	for _, want := range []string{"c      | got SIGTERM", "launch | bb (pid " + strconv.Itoa(kids[1].Pid) + ") exited: exit status 0"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
}

func TestChildExitingBeforeReadyIsNamedWithItsOutput(t *testing.T) {
	out := &syncbuf.Buffer{}
	_, err := Start(t.Context(), []Spec{testSpec(t, "good", "serve"), testSpec(t, "bad", "exit")}, testOptions(out))
	ce, ok := errors.AsType[*ChildError](err)
	if !ok {
		t.Fatalf("err = %v, want a *ChildError", err)
	}
	if ce.Name != "bad" || !ce.BeforeReady || ce.Status != "exit status 3" || !strings.Contains(strings.Join(ce.Output, "\n"), "about to fail") {
		t.Fatalf("error %+v", ce)
	}
	if msg := err.Error(); !strings.Contains(msg, "bad (test, pid ") || !strings.Contains(msg, "exited before it was ready: exit status 3; last output:\n    about to fail") {
		t.Errorf("message %q", msg)
	}
	if errors.Is(err, ErrAddrInUse) {
		t.Error("an ordinary failure matched ErrAddrInUse")
	}
	// The other child was stopped and reaped before Start returned.
	m := regexp.MustCompile(`(?m)^launch \| good \(pid (\d+)\) exited: `).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("the other child's end is not reported:\n%s", out)
	}
	pid, _ := strconv.Atoi(m[1])
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("good (pid %d) left running: %v", pid, err)
	}
}

func TestChildDyingWhileRunningStopsTheOthers(t *testing.T) {
	out := &syncbuf.Buffer{}
	a, b := testSpec(t, "a", "serve"), testSpec(t, "b", "serve")
	c, err := Start(t.Context(), []Spec{a, b}, testOptions(out))
	if err != nil {
		t.Fatal(err)
	}
	kids := c.Children()
	resp, err := http.Get(strings.Replace(a.HealthURL, "/health", "/die", 1))
	if err == nil {
		resp.Body.Close()
	}
	err = c.Run(t.Context())
	ce, ok := errors.AsType[*ChildError](err)
	if !ok {
		t.Fatalf("Run = %v, want a *ChildError", err)
	}
	if ce.Name != "a" || ce.Pid != kids[0].Pid || ce.BeforeReady || ce.Status != "exit status 4" || !strings.Contains(strings.Join(ce.Output, "\n"), "dying as asked") {
		t.Fatalf("error %+v", ce)
	}
	s := out.String()
	if !strings.Contains(s, fmt.Sprintf("launch | a (test, pid %d) exited: exit status 4; last output:", kids[0].Pid)) {
		t.Errorf("the death is not reported:\n%s", s)
	}
	if !strings.Contains(s, "b      | got SIGTERM") {
		t.Errorf("b was not sent SIGTERM:\n%s", s)
	}
	for _, k := range kids {
		if err := syscall.Kill(k.Pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) not reaped: %v", k.Name, k.Pid, err)
		}
	}
}

func TestChildIgnoringSIGTERMIsKilledAfterTheGrace(t *testing.T) {
	out := &syncbuf.Buffer{}
	opts := testOptions(out)
	opts.Grace = 300 * time.Millisecond
	specs := []Spec{
		testSpec(t, "stubborn", "serve", stubbornEnv+"=1", grandchildEnv+"=sleep"),
		testSpec(t, "polite", "serve"),
	}
	c, err := Start(t.Context(), specs, opts)
	if err != nil {
		t.Fatal(err)
	}
	kids := c.Children()
	gc, _ := strconv.Atoi(waitMatch(t, out, `(?m)^stubborn \| grandchild pid (\d+)$`)[1])
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	start := time.Now()
	err = c.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("killed after the 300ms grace period: stubborn (pid %d)", kids[0].Pid)) {
		t.Fatalf("Run = %v", err)
	}
	if el := time.Since(start); el < opts.Grace {
		t.Errorf("killed after %v, before the grace", el)
	}
	for _, k := range kids {
		if err := syscall.Kill(k.Pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) not reaped: %v", k.Name, k.Pid, err)
		}
	}
	mustGone(t, "grandchild", gc)
	if s := out.String(); !strings.Contains(s, "stubborn (pid "+strconv.Itoa(kids[0].Pid)+") exited: signal: killed") {
		t.Errorf("output:\n%s", s)
	}
}

func TestGrandchildOutlivingItsParentIsKilled(t *testing.T) {
	out := &syncbuf.Buffer{}
	opts := testOptions(out)
	opts.Grace = 200 * time.Millisecond
	// The grandchild ignores SIGTERM (it inherits the setting); the child does not.
	c, err := Start(t.Context(), []Spec{testSpec(t, "a", "serve", grandchildEnv+"=sleep")}, opts)
	if err != nil {
		t.Fatal(err)
	}
	gc, _ := strconv.Atoi(waitMatch(t, out, `(?m)^a      \| grandchild pid (\d+)$`)[1])
	if err := syscall.Kill(gc, syscall.SIGSTOP); err != nil { // stopped: SIGTERM stays pending
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := c.Run(ctx); err != nil {
		t.Fatalf("Run = %v\n%s", err, out)
	}
	mustGone(t, "grandchild", gc)
	if s := out.String(); !strings.Contains(s, "killed what a left running in its process group") {
		t.Errorf("output:\n%s", s)
	}
}

func TestLaunchRetriesOnceWhenAPortIsTaken(t *testing.T) {
	out := &syncbuf.Buffer{}
	calls := 0
	c, err := Launch(t.Context(), func() ([]Spec, error) {
		calls++
		if calls == 1 {
			return []Spec{testSpec(t, "a", "addrinuse")}, nil
		}
		return []Spec{testSpec(t, "a", "serve")}, nil
	}, testOptions(out))
	if err != nil {
		t.Fatal(err)
	}
	if calls != 2 {
		t.Errorf("built %d times", calls)
	}
	if !strings.Contains(out.String(), "retrying once with fresh ports") {
		t.Errorf("output:\n%s", out)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := c.Run(ctx); err != nil {
		t.Fatal(err)
	}

	// Twice taken: the second error is returned.
	_, err = Launch(t.Context(), func() ([]Spec, error) { return []Spec{testSpec(t, "a", "addrinuse")}, nil }, testOptions(out))
	if !errors.Is(err, ErrAddrInUse) {
		t.Fatalf("err = %v", err)
	}
}

// TestLaunchDoesNotRetryFixedPorts: a child whose port the user chose
// fails with ErrAddrInUse at once; building fresh ports again would not
// free it.
func TestLaunchDoesNotRetryFixedPorts(t *testing.T) {
	out := &syncbuf.Buffer{}
	calls := 0
	_, err := Launch(t.Context(), func() ([]Spec, error) {
		calls++
		s := testSpec(t, "router", "addrinuse")
		s.FixedPorts = true
		return []Spec{s}, nil
	}, testOptions(out))
	if !errors.Is(err, ErrAddrInUse) {
		t.Fatalf("err = %v", err)
	}
	if calls != 1 || strings.Contains(out.String(), "retrying") {
		t.Errorf("built %d times, want 1 (no retry); output:\n%s", calls, out)
	}
}

func TestNotReadyInTime(t *testing.T) {
	out := &syncbuf.Buffer{}
	opts := testOptions(out)
	opts.ReadyTimeout = 200 * time.Millisecond
	s := testSpec(t, "slow", "sleep") // never listens
	_, err := Start(t.Context(), []Spec{s}, opts)
	if err == nil || !strings.Contains(err.Error(), "not ready after 200ms:\n  slow (test, pid ") {
		t.Fatalf("err = %v", err)
	}
}

func TestStartRefusesBadSpecs(t *testing.T) {
	s := Spec{Name: "a", Path: "/bin/true"}
	if _, err := Start(t.Context(), []Spec{s, s}, Options{}); err == nil {
		t.Error("duplicate names accepted")
	}
	if _, err := Start(t.Context(), []Spec{{Name: "x"}}, Options{}); err == nil {
		t.Error("a spec without a path accepted")
	}
	_, err := Start(t.Context(), []Spec{{Name: "x", Path: "/nonexistent/program"}}, Options{Output: &syncbuf.Buffer{}})
	if err == nil || !strings.Contains(err.Error(), "start x") {
		t.Errorf("err = %v", err)
	}
}

func TestFreePortsAreDistinct(t *testing.T) {
	ports, err := FreePorts(8)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if p <= 0 || seen[p] {
			t.Fatalf("ports %v", ports)
		}
		seen[p] = true
	}
}

func TestTailKeepsTheLastLines(t *testing.T) {
	tl := newTail(3)
	for i := range 7 {
		tl.add(strconv.Itoa(i))
	}
	if got := strings.Join(tl.lines(), ","); got != "4,5,6" {
		t.Fatalf("tail %s", got)
	}
}
