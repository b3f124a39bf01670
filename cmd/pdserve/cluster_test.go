package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// realEnv makes the test binary, started through a wrapper script, run as
// the real pdserve: main's command tree on the arguments after "--".
const realEnv = "PDSERVE_CLUSTER_REAL"

// TestClusterRealServer is not a test: it is the pdserve every server of
// TestClusterLaunch runs (this test binary, with main's signal handling).
func TestClusterRealServer(t *testing.T) {
	if os.Getenv(realEnv) == "" {
		t.Skip("the real pdserve of TestClusterLaunch")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	cmd := newRootCmd()
	cmd.SetArgs(flag.Args())
	err := cmd.ExecuteContext(ctx)
	stop()
	os.Exit(exitCode(err))
}

// A whole PD cluster as real processes: pdserve launch with a prefill, a
// decode and a router. A greedy completion through the router equals
// pdserve generate's; then the prefill is killed while a long streaming
// request waits for its KV: the request fails within the decode's heartbeat
// window, launch reports the dead child and exits 1, and no server process
// is left.
func TestClusterLaunch(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	const prompt, maxTok = "Once upon a time", 16
	out, stderr, code := run(t, "generate", "--model", path, "--threads", "1", "--prompt", prompt,
		"--max-tokens", strconv.Itoa(maxTok), "--temperature", "0")
	if code != 0 {
		t.Fatalf("generate: exit %d: %s", code, stderr)
	}
	want, ok := strings.CutSuffix(out, "\n")
	if !ok || want == "" {
		t.Fatalf("generate printed %q", out)
	}

	// The servers are this test binary behind a wrapper script, as
	// startFakeLaunch does, but running the real commands.
	dir := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, "pdserve")
	body := fmt.Sprintf("#!/bin/sh\nexec %s -test.run='^TestClusterRealServer$' -- \"$@\"\n", strconv.Quote(self))
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	saved := launchExecutable
	launchExecutable = func() (string, error) { return script, nil }
	t.Cleanup(func() { launchExecutable = saved })
	t.Setenv(realEnv, "1")
	t.Setenv("GORACE", "atexit_sleep_ms=0")
	t.Setenv("PD_THREADS", "1") // reaches the servers: generate's numerics, and fewer threads

	stdout, errb := &syncbuf.Buffer{}, &syncbuf.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := newRootCmd()
	cmd.SetArgs([]string{"launch", "--model", path, "--port", "0", "--prefill", "1", "--decode", "1",
		"--stop-timeout", "10s", "--ready-timeout", "60s"})
	cmd.SetOut(stdout)
	cmd.SetErr(errb)
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()
	var pids []int
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("launch did not stop")
		}
		for _, pid := range pids { // a failed test leaves nothing either
			if syscall.Kill(pid, 0) == nil {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})

	// The endpoint table.
	table := regexp.MustCompile(`(?m)^(prefill|decode|router) +(\S+) +(http://127\.0\.0\.1:\d+) +(\d+)`)
	var rows [][]string
	printed := waitfor.Poll(90*time.Second, func() bool {
		if s := stdout.String(); strings.Contains(s, "curl -s") {
			rows = table.FindAllStringSubmatch(s, -1)
			return true
		}
		select {
		case err := <-done:
			t.Fatalf("launch ended: %v\n%s", err, errb)
		default:
		}
		return false
	})
	if !printed {
		t.Fatalf("no endpoint table:\n%s\n%s", stdout, errb)
	}
	urls, pid := map[string]string{}, map[string]int{}
	for _, r := range rows {
		urls[r[1]] = r[3]
		pid[r[1]], _ = strconv.Atoi(r[4])
		pids = append(pids, pid[r[1]])
	}
	if len(rows) != 3 || urls["prefill"] == "" || urls["decode"] == "" || urls["router"] == "" {
		t.Fatalf("endpoint table:\n%s", stdout)
	}
	client := &http.Client{Timeout: 30 * time.Second}
	get := func(url string, v any) int {
		resp, err := client.Get(url)
		if err != nil {
			return 0
		}
		defer resp.Body.Close()
		if v != nil {
			json.NewDecoder(resp.Body).Decode(v)
		}
		return resp.StatusCode
	}
	if !waitfor.Poll(20*time.Second, func() bool { return get(urls["router"]+"/health", nil) == 200 }) {
		t.Fatalf("router not healthy:\n%s", errb)
	}

	// Greedy through the router equals generate.
	b, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTok, "temperature": 0})
	resp, err := client.Post(urls["router"]+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	var cr openai.CompletionResponse
	err = json.NewDecoder(resp.Body).Decode(&cr)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || len(cr.Choices) != 1 {
		t.Fatalf("completion through the router: %d %v %+v", resp.StatusCode, err, cr)
	}
	if got := cr.Choices[0].Text; got != want {
		t.Errorf("through the router %q, generate %q", got, want)
	}

	var info struct {
		BootstrapURL string `json:"bootstrap_url"`
	}
	if get(urls["prefill"]+"/pd/v1/info", &info); info.BootstrapURL == "" {
		t.Fatalf("the prefill reports no bootstrap URL")
	}
	var decodeInfo struct {
		ID string `json:"id"`
	}
	if get(urls["decode"]+"/pd/v1/info", &decodeInfo); decodeInfo.ID == "" {
		t.Fatalf("the decode reports no id")
	}

	// The prefill is stopped first, so that a long streaming request is
	// certain to wait for its KV (the decode reaches its transfer queue
	// on its own: the registry's answer is cached), then killed. A second
	// request goes to the decode alone, as a router would send its half:
	// nothing cancels it, so only the decode's heartbeat can fail it.
	if err := syscall.Kill(pid["prefill"], syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	type direct struct {
		status int
		body   string
		err    error
	}
	// The direct half is signed with launch's cluster secret, as the
	// router signs its own; unsigned, the decode refuses it at once.
	secretFile := regexp.MustCompile(`--cluster-secret-file (\S+)`).FindStringSubmatch(errb.String())
	if secretFile == nil {
		t.Fatalf("launch did not say where its cluster secret is:\n%s", errb)
	}
	secret, err := clusterauth.Load("", secretFile[1])
	if err != nil {
		t.Fatal(err)
	}
	directBody, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 8, "temperature": 0,
		"bootstrap_room": 4242, "bootstrap_url": info.BootstrapURL})
	if resp, err := client.Post(urls["decode"]+"/v1/completions", "application/json", bytes.NewReader(directBody)); err != nil {
		t.Fatal(err)
	} else {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("an unsigned PD request to launch's decode: %d %s, want 401", resp.StatusCode, body)
		}
	}
	dres := make(chan direct, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, urls["decode"]+"/v1/completions", bytes.NewReader(directBody))
		req.Header.Set("Content-Type", "application/json")
		secret.SignRequest(req, directBody, time.Now(), decodeInfo.ID)
		resp, err := client.Do(req)
		if err != nil {
			dres <- direct{err: err}
			return
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		dres <- direct{status: resp.StatusCode, body: string(body), err: err}
	}()
	b, _ = json.Marshal(map[string]any{"prompt": prompt + " there was a long story", "max_tokens": 400, "temperature": 0,
		"ignore_eos": true, "stream": true})
	type result struct {
		status int
		text   string
		events int
		done   bool
		err    error
	}
	res := make(chan result, 1)
	go func() {
		var r result
		defer func() { res <- r }()
		resp, err := client.Post(urls["router"]+"/v1/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			r.err = err
			return
		}
		defer resp.Body.Close()
		r.status = resp.StatusCode
		if resp.StatusCode != 200 {
			body, _ := io.ReadAll(resp.Body)
			r.text = string(body)
			return
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			if data == "[DONE]" {
				r.done = true
				continue
			}
			r.events++
			r.text += data + "\n"
		}
		r.err = sc.Err()
	}()
	waiting := waitfor.Poll(20*time.Second, func() bool {
		var pd debug.PDResponse
		get(urls["decode"]+debug.PDPath+"?queue="+debug.PDQueueTransfer, &pd)
		return len(pd.Ranks) == 1 && len(pd.Ranks[0].Entries) == 2
	})
	if !waiting {
		t.Fatalf("the requests never waited in the decode's transfer queue:\n%s", errb)
	}
	killed := time.Now()
	if err := syscall.Kill(pid["prefill"], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-res:
	case <-time.After(15 * time.Second):
		t.Fatalf("the request still runs 15s after the prefill died")
	}
	took := time.Since(killed)
	t.Logf("request ended %v after the kill: status %d, %d events, done %v, %v: %.300s", took.Round(time.Millisecond), r.status, r.events, r.done, r.err, r.text)
	if r.status == 200 && (r.done || !strings.Contains(r.text, `"error"`)) {
		t.Errorf("the request did not fail with an error: status %d, %d events, done %v: %.300s", r.status, r.events, r.done, r.text)
	}
	if took > 6*time.Second {
		t.Errorf("the request failed %v after the prefill died; want within the heartbeat window (3s)", took)
	}

	select {
	case d := <-dres:
		took := time.Since(killed)
		t.Logf("the decode's own request ended %v after the kill: %d %v %s", took.Round(time.Millisecond), d.status, d.err, d.body)
		if d.err != nil || d.status == 200 || !strings.Contains(d.body, "silent") {
			t.Errorf("the decode's own request: %d %v %s; want failed by the heartbeat", d.status, d.err, d.body)
		}
		if took > 6*time.Second {
			t.Errorf("the decode's own request failed %v after the prefill died; want within the heartbeat window (3s)", took)
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("the decode's own request still runs 15s after the prefill died")
	}

	// launch reports the dead child, stops the others and exits 1.
	var lerr error
	select {
	case lerr = <-done:
		done <- lerr // for the cleanup
	case <-time.After(30 * time.Second):
		t.Fatalf("launch still runs after its prefill died:\n%s", errb)
	}
	msg := fmt.Sprintf("prefill-0 (prefill, pid %d) exited: signal: killed", pid["prefill"])
	if lerr == nil || !strings.Contains(lerr.Error(), msg) {
		t.Errorf("launch returned %v; want %q", lerr, msg)
	}
	saved2 := os.Stderr
	os.Stderr, _ = os.Open(os.DevNull)
	c := exitCode(lerr)
	os.Stderr = saved2
	if c != 1 {
		t.Errorf("launch's exit code %d, want 1", c)
	}
	for name, p := range pid {
		if err := syscall.Kill(p, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) left behind: kill 0: %v", name, p, err)
		}
	}
}
