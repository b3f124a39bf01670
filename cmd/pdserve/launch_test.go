package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/waitfor"
)

func TestLaunchUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"launch", "--prefill", "0"},
		{"launch", "--decode", "-1"},
		{"launch", "--tp", "0"},
		{"launch", "--port", "70000"},
		{"launch", "--port", "-1"},
		{"launch", "--port", "x"},
		{"launch", "--fault", ""},
		{"launch", "--fault", "no-such-fault"},
		{"launch", "--stop-timeout", "0s"},
		{"launch", "--kv-dtype", "q8_0"},
		{"launch", "--kv-memory", "lots"},
		{"launch", "--kv-memory", "1.5"},
		{"launch", "extra"},
		{"launch", "--no-such-flag"},
	} {
		if _, stderr, code := run(t, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr)
		}
	}
	t.Setenv("PD_TP", "0")
	if _, stderr, code := run(t, "launch"); code != 2 || !strings.Contains(stderr, "--tp 0") {
		t.Errorf("PD_TP=0: exit %d: %s", code, stderr)
	}
	t.Setenv("PD_TP", "")
	t.Setenv("PD_PREFILL", "many")
	if _, stderr, code := run(t, "launch"); code != 2 || !strings.Contains(stderr, "PD_PREFILL") {
		t.Errorf("PD_PREFILL=many: exit %d: %s", code, stderr)
	}
}

func TestLaunchSpecs(t *testing.T) {
	p := launchPlan{exe: "/bin/pdserve", model: "/m.gguf", routerPort: 8000, tp: 2,
		prefill: []prefillPorts{{101, 201}, {102, 202}}, decode: []int{301}, faults: []string{"bootstrap-abort-crash"},
		engineArgs: []string{"--kv-dtype=f32"}, prefillArgs: []string{"--hicache=true"}}
	var got []string
	for _, s := range p.specs() {
		got = append(got, fmt.Sprintf("%s %s %s %s %s", s.Role, s.Name, s.Path, strings.Join(s.Args, " "), s.HealthURL))
	}
	want := []string{
		"prefill prefill-0 /bin/pdserve prefill --model /m.gguf --port 101 --bootstrap-port 201 --tp 2 --hicache=true --kv-dtype=f32 --fault bootstrap-abort-crash http://127.0.0.1:101/health",
		"prefill prefill-1 /bin/pdserve prefill --model /m.gguf --port 102 --bootstrap-port 202 --tp 2 --hicache=true --kv-dtype=f32 --fault bootstrap-abort-crash http://127.0.0.1:102/health",
		"decode decode-0 /bin/pdserve decode --model /m.gguf --port 301 --tp 2 --prefill-bootstrap http://127.0.0.1:201,http://127.0.0.1:202 --kv-dtype=f32 http://127.0.0.1:301/health",
		"router router /bin/pdserve router --port 8000 --prefill http://127.0.0.1:101,http://127.0.0.1:102 --decode http://127.0.0.1:301 http://127.0.0.1:8000/health",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("specs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// fakeEnv makes the test binary, started through a wrapper script, play a
// pdserve server: the value is a folder where it records its command line.
const fakeEnv = "PDSERVE_LAUNCH_FAKE"

// TestLaunchFakeServer is not a test: it is the fake server launch starts.
func TestLaunchFakeServer(t *testing.T) {
	dir := os.Getenv(fakeEnv)
	if dir == "" {
		t.Skip("the fake server of TestLaunchEndToEnd")
	}
	args := flag.Args()
	port := args[slices.Index(args, "--port")+1]
	rec := strings.Join(args, " ") + "\nPD_PREFILL=" + os.Getenv("PD_PREFILL") + "\nPD_MAX_RUNNING=" + os.Getenv("PD_MAX_RUNNING") + "\n"
	if err := os.WriteFile(filepath.Join(dir, args[0]+"-"+port), []byte(rec), 0o644); err != nil {
		panic(err)
	}
	if os.Getenv(fakeEnv+"_DIE") == args[0] {
		fmt.Fprintln(os.Stderr, "fake", args[0], "giving up")
		os.Exit(3)
	}
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	ln, err := net.Listen("tcp", "127.0.0.1:"+port)
	if err != nil {
		panic(err)
	}
	go http.Serve(ln, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	fmt.Fprintf(os.Stderr, "fake %s on http://%s\n", args[0], ln.Addr())
	<-term
	os.Exit(0)
}

// startFakeLaunch runs `pdserve launch args...` in process with fake
// servers; it returns the output buffers, a cancel (the signal) and the
// exit code's channel.
func startFakeLaunch(t *testing.T, args ...string) (dir string, stdout, stderr *syncbuf.Buffer, cancel func(), code chan int) {
	t.Helper()
	dir = t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, "pdserve")
	body := fmt.Sprintf("#!/bin/sh\nexec %s -test.run='^TestLaunchFakeServer$' -- \"$@\"\n", strconv.Quote(self))
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	model := filepath.Join(dir, "model.gguf")
	if err := os.WriteFile(model, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	saved := launchExecutable
	launchExecutable = func() (string, error) { return script, nil }
	t.Cleanup(func() { launchExecutable = saved })
	t.Setenv(fakeEnv, dir)
	t.Setenv("GORACE", "atexit_sleep_ms=0") // a -race child exits at once

	stdout, stderr = &syncbuf.Buffer{}, &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(t.Context())
	cmd := newRootCmd()
	cmd.SetArgs(append([]string{"launch", "--model", model, "--port", "0", "--stop-timeout", "5s", "--ready-timeout", "20s"}, args...))
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	code = make(chan int, 1)
	go func() {
		err := cmd.ExecuteContext(ctx)
		if err != nil {
			fmt.Fprintln(stderr, "pdserve:", err)
		}
		c := 1
		switch {
		case err == nil:
			c = 0
		case strings.Contains(err.Error(), "interrupted"):
			c = 130
		}
		code <- c
	}()
	t.Cleanup(func() {
		cancel()
		<-code
	})
	return dir, stdout, stderr, cancel, code
}

func TestLaunchEndToEnd(t *testing.T) {
	t.Setenv("PD_PREFILL", "2") // launch's own setting: not passed on
	t.Setenv("PD_MAX_RUNNING", "3")
	t.Setenv("PD_HICACHE_WRITE_POLICY", "write-back") // launch's own too: passed on as a flag
	t.Setenv("PD_KV_DTYPE", "bf16")                   // likewise
	dir, stdout, stderr, cancel, code := startFakeLaunch(t, "--decode", "1", "--tp", "2", "--fault", "bootstrap-abort-crash", "--hicache", "--hicache-size", "64MiB", "--kv-memory", "0.05")
	printed := waitfor.Poll(30*time.Second, func() bool {
		select {
		case c := <-code:
			t.Fatalf("launch exited %d:\n%s", c, stderr)
		default:
		}
		return strings.Contains(stdout.String(), "curl -s")
	})
	if !printed {
		t.Fatalf("no endpoint table:\n%s\n%s", stdout, stderr)
	}
	out := stdout.String()
	for _, re := range []string{
		`(?m)^ROLE +NAME +URL +PID$`,
		`(?m)^prefill +prefill-0 +http://127\.0\.0\.1:\d+ +\d+ +bootstrap http://127\.0\.0\.1:\d+$`,
		`(?m)^prefill +prefill-1 +http://127\.0\.0\.1:\d+ +\d+ +bootstrap`,
		`(?m)^decode +decode-0 +http://127\.0\.0\.1:\d+ +\d+$`,
		`(?m)^router +router +http://127\.0\.0\.1:\d+ +\d+$`,
		`(?m)^curl -s http://127\.0\.0\.1:\d+/v1/completions -d '\{"prompt": "Once upon a time", "max_tokens": 32\}'$`,
	} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("stdout lacks %s:\n%s", re, out)
		}
	}
	recs, _ := filepath.Glob(filepath.Join(dir, "*-*"))
	var all string
	for _, r := range recs {
		b, _ := os.ReadFile(r)
		all += string(b)
	}
	for _, re := range []string{
		`prefill --model \S+model\.gguf --port \d+ --bootstrap-port \d+ --tp 2 --hicache=true --hicache-size=64MiB --hicache-write-policy=write-back --kv-dtype=bf16 --kv-memory=5% --fault bootstrap-abort-crash\n`,
		`decode --model \S+model\.gguf --port \d+ --tp 2 --prefill-bootstrap http://127\.0\.0\.1:\d+,http://127\.0\.0\.1:\d+ --kv-dtype=bf16 --kv-memory=5%\n`,
		`router --port \d+ --prefill http://127\.0\.0\.1:\d+,http://127\.0\.0\.1:\d+ --decode http://127\.0\.0\.1:\d+\n`,
	} {
		if !regexp.MustCompile(re).MatchString(all) {
			t.Errorf("no command line matches %s:\n%s", re, all)
		}
	}
	if strings.Count(all, "PD_PREFILL=\n") != 4 || strings.Count(all, "PD_MAX_RUNNING=3\n") != 4 {
		t.Errorf("child environments:\n%s", all)
	}
	cancel()
	if c := <-code; c != 0 {
		t.Errorf("launch exited %d after the signal:\n%s", c, stderr)
	}
	code <- 0 // for the cleanup
	if s := stderr.String(); !strings.Contains(s, "router    | fake router on http://") || !strings.Contains(s, "launch    | decode-0 (pid ") {
		t.Errorf("stderr:\n%s", s)
	}
}

func TestLaunchReportsADyingServer(t *testing.T) {
	t.Setenv(fakeEnv+"_DIE", "decode")
	_, _, stderr, _, code := startFakeLaunch(t)
	var c int
	select {
	case c = <-code:
	case <-time.After(30 * time.Second):
		t.Fatalf("launch still runs:\n%s", stderr)
	}
	code <- c
	s := stderr.String()
	if c != 1 || !regexp.MustCompile(`pdserve: launch: decode-0 \(decode, pid \d+\) exited before it was ready: exit status 3; last output:\n(.*\n)*    fake decode giving up`).MatchString(s) {
		t.Errorf("exit %d:\n%s", c, s)
	}
}
