package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

// serving is a pdserve serve running in process.
type serving struct {
	url    string
	errb   *syncbuf.Buffer
	cancel context.CancelFunc
	done   chan error
}

// startServe runs the serve command with args (after "serve --port 0")
// in process and waits until it listens. The server is shut down when the
// test ends, if it still runs.
func startServe(t *testing.T, args ...string) *serving {
	t.Helper()
	s := &serving{errb: &syncbuf.Buffer{}, done: make(chan error, 1)}
	var out syncbuf.Buffer
	cmd := newRootCmd()
	cmd.SetArgs(append([]string{"serve", "--port", "0"}, args...))
	cmd.SetOut(&out)
	cmd.SetErr(s.errb)
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go func() { s.done <- cmd.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-s.done:
		case <-time.After(20 * time.Second):
			t.Error("serve did not shut down")
		}
	})

	re := regexp.MustCompile(`on (http://[0-9.:]+)\n`)
	listening := waitfor.Poll(20*time.Second, func() bool {
		if m := re.FindStringSubmatch(s.errb.String()); m != nil {
			s.url = m[1]
			return true
		}
		select {
		case err := <-s.done:
			s.done <- err
			t.Fatalf("serve ended early: %v: %s", err, s.errb.String())
		default:
		}
		return false
	})
	if !listening {
		t.Fatalf("no listening URL: %s", s.errb.String())
	}
	return s
}

func TestServe(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	s := startServe(t, "--model", path, "--threads", "1", "--model-name", "tiny", "--shutdown-timeout", "1ms")
	url, cancel, done := s.url, s.cancel, s.done
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var ml openai.ModelList
	if resp.StatusCode != 200 || json.Unmarshal(b, &ml) != nil || len(ml.Data) != 1 || ml.Data[0].ID != "tiny" {
		t.Fatalf("/v1/models: %d %s", resp.StatusCode, b)
	}
	// The engine reports to /metrics as it runs.
	cresp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(`{"prompt": "hi", "max_tokens": 3, "ignore_eos": true}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, cresp.Body)
	cresp.Body.Close()
	mresp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, want := range []string{"pdkit_generation_tokens_total 3", "pdkit_time_to_first_token_seconds_count 1", `pdkit_requests_total{finish_reason="length"} 1`} {
		if !strings.Contains(string(mb), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// A stream in flight when the server shuts down runs until the
	// shutdown's deadline (1ms here), then ends with an error event and
	// [DONE], and the response ends cleanly: the client knows it was cut.
	body := `{"prompt": "hi", "max_tokens": 400, "ignore_eos": true, "stream": true}`
	sresp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer sresp.Body.Close()
	rd := bufio.NewReader(sresp.Body)
	if line, err := rd.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("stream: %q %v", line, err)
	}
	cancel()
	select {
	case err := <-done:
		done <- err // for the cleanup
		if err != nil {
			t.Fatalf("serve: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not shut down")
	}
	rest, err := io.ReadAll(rd)
	if err != nil {
		t.Errorf("the cut stream did not end cleanly: %v", err)
	}
	if !strings.Contains(string(rest), `data: {"error":{"message":"the server shut down before the request finished"`) ||
		!strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Errorf("the cut stream ends with %q", rest[max(0, len(rest)-300):])
	}
	if _, err := http.Get(url + "/health"); err == nil {
		t.Error("still answering after shutdown")
	}
}

// Greedy completions served over HTTP equal what pdserve generate prints for
// the same prompts and max tokens, completed concurrently, streamed or not.
func TestGenerateMatchesServe(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	prompts := []struct {
		text   string
		maxTok int
	}{
		{"Once upon a time", 16},
		{"The little robot looked at the stars and said", 24},
		{"hi", 5},
		{"A long time ago, in a workshop full of gears, springs and wires, there lived", 32},
	}
	want := make([]string, len(prompts))
	for i, p := range prompts {
		out, stderr, code := run(t, "generate", "--model", path, "--threads", "1", "--prompt", p.text,
			"--max-tokens", strconv.Itoa(p.maxTok), "--temperature", "0")
		if code != 0 {
			t.Fatalf("generate %q: exit %d: %s", p.text, code, stderr)
		}
		text, ok := strings.CutSuffix(out, "\n")
		if !ok {
			t.Fatalf("generate %q: output %q does not end its line", p.text, out)
		}
		want[i] = text
		t.Logf("generate %q: %q", p.text, text)
	}
	if strings.Join(want, "") == "" {
		t.Fatal("generate printed no text for any prompt: a weak test")
	}

	s := startServe(t, "--model", path, "--threads", "1", "--page-size", "4", "--max-running", "4")
	var wg sync.WaitGroup
	for i, p := range prompts {
		for _, stream := range []bool{false, true} {
			wg.Go(func() {
				body, _ := json.Marshal(map[string]any{"prompt": p.text, "max_tokens": p.maxTok, "temperature": 0, "stream": stream})
				resp, err := http.Post(s.url+"/v1/completions", "application/json", bytes.NewReader(body))
				if err != nil {
					t.Error(err)
					return
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				if err != nil || resp.StatusCode != 200 {
					t.Errorf("prompt %d: %d %v %s", i, resp.StatusCode, err, b)
					return
				}
				var got string
				if !stream {
					var r openai.CompletionResponse
					if err := json.Unmarshal(b, &r); err != nil || len(r.Choices) != 1 {
						t.Errorf("prompt %d: %v %s", i, err, b)
						return
					}
					got = r.Choices[0].Text
				} else {
					for line := range strings.Lines(string(b)) {
						data, ok := strings.CutPrefix(strings.TrimSpace(line), "data: ")
						if !ok || data == "[DONE]" {
							continue
						}
						var c openai.CompletionChunk
						if err := json.Unmarshal([]byte(data), &c); err != nil {
							t.Errorf("prompt %d: %v %s", i, err, data)
							return
						}
						for _, ch := range c.Choices {
							got += ch.Text
						}
					}
				}
				if got != want[i] {
					t.Errorf("prompt %q (stream %v): served %q, generate printed %q", p.text, stream, got, want[i])
				}
			})
		}
	}
	wg.Wait()
}

func TestServeUsageErrors(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	for _, args := range [][]string{
		{"serve", "--model", path, "--port", "-1"},
		{"serve", "--model", path, "--backend", "tpu"},
		{"serve", "--model", path, "--tp", "3"},
		{"serve", "--model", path, "--index-k", "fp4"},
		{"serve", "--model", path, "--kv-dtype", "f64"},
		{"prefill", "--model", path, "--kv-dtype", "q8_0"},
		{"decode", "--model", path, "--kv-dtype", "BF16"},
		{"serve", "--model", path, "--schedule", "fast"},
		{"decode", "--model", path, "--schedule", "Overlap"},
		{"serve", "extra"},
	} {
		if _, stderr, code := run(t, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr)
		}
	}
}

// A bad setting is refused at start-up by what it configures (the
// listeners, the HTTP server's Options, the engine's Config and its PD
// machine), once, in words that name the flag typed.
func TestServeSettingErrors(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--port", "70000"}, "--port 70000: want 0 to 65535"},
		{[]string{"prefill", "--bootstrap-port", "-1"}, "--bootstrap-port -1: want 0 to 65535"},
		{[]string{"serve", "--shutdown-timeout", "0s"}, "--shutdown-timeout 0s must be positive"},
		{[]string{"serve", "--stall-after", "-1s"}, "stall after -1s (--stall-after) must not be negative"},
		{[]string{"decode", "--max-queue-age", "-1s"}, "max queue age -1s (--max-queue-age) must not be negative"},
		{[]string{"serve", "--collective-timeout", "2s"}, "collective timeout 2s (--collective-timeout) must exceed the collective watchdog 5s (--stall-after)"},
		{[]string{"serve", "--collective-timeout", "5s", "--stall-after", "5s"}, "(--collective-timeout) must exceed the collective watchdog 5s (--stall-after)"},
		{[]string{"serve", "--collective-timeout", "-1s"}, "collective timeout -1s (--collective-timeout)"},
		{[]string{"serve", "--stall-after", "10ms"}, "shorter than the collective watchdog 10ms (--stall-after)"},
		{[]string{"decode", "--bootstrap-timeout", "-1s"}, "rooms: bootstrap timeout -1s (--bootstrap-timeout) must be positive"},
		{[]string{"prefill", "--inflight-timeout", "-1s"}, "rooms: inflight timeout -1s (--inflight-timeout) must be positive"},
		{[]string{"decode", "--heartbeat-timeout", "-1s"}, "rooms: heartbeat timeout -1s (--heartbeat-timeout) must be positive"},
		{[]string{"decode", "--heartbeat-interval", "5s"}, "PD heartbeat interval 5s (--heartbeat-interval) must be positive and shorter than the heartbeat timeout 3s (--heartbeat-timeout)"},
		{[]string{"prefill", "--max-peer-sockets", "-1"}, "(--max-peer-sockets) must not be negative"},
	} {
		args := append(tc.args, "--model", path, "--port", "0", "--threads", "1")
		if tc.args[1] == "--port" {
			args = append(tc.args, "--model", path, "--threads", "1")
		}
		_, stderr, code := run(t, args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
		if n := strings.Count(stderr, tc.want); n > 1 {
			t.Errorf("%v: said %d times: %q", tc.args, n, stderr)
		}
	}
}

// --admin-token (or PD_ADMIN_TOKEN) protects /admin/v1/; without one a
// server beyond loopback refuses admin calls and says so at start-up.
func TestServeAdminToken(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	start := func(args ...string) (url string, errb *syncbuf.Buffer, stop func()) {
		t.Helper()
		errb = &syncbuf.Buffer{}
		cmd := newRootCmd()
		cmd.SetArgs(append([]string{"serve", "--model", path, "--port", "0", "--threads", "1", "--shutdown-timeout", "1ms"}, args...))
		cmd.SetOut(io.Discard)
		cmd.SetErr(errb)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- cmd.ExecuteContext(ctx) }()
		stop = func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
		}
		re := regexp.MustCompile(`on http://\S*:([0-9]+)\n`)
		var port string
		listening := waitfor.Poll(20*time.Second, func() bool {
			if m := re.FindStringSubmatch(errb.String()); m != nil {
				port = m[1]
				return true
			}
			select {
			case err := <-done:
				t.Fatalf("serve ended early: %v: %s", err, errb.String())
			default:
			}
			return false
		})
		if !listening {
			cancel()
			t.Fatalf("no listening URL: %s", errb.String())
		}
		return "http://127.0.0.1:" + port, errb, stop
	}
	abortAll := func(url, auth string) int {
		t.Helper()
		req, _ := http.NewRequest("POST", url+"/admin/v1/abort_all", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}

	t.Setenv("PD_ADMIN_TOKEN", "tok")
	url, _, stop := start()
	if c1, c2, c3 := abortAll(url, ""), abortAll(url, "Bearer nope"), abortAll(url, "Bearer tok"); c1 != 401 || c2 != 401 || c3 != 200 {
		t.Errorf("with PD_ADMIN_TOKEN: %d %d %d, want 401 401 200", c1, c2, c3)
	}
	stop()

	t.Setenv("PD_ADMIN_TOKEN", "")
	url, _, stop = start() // 127.0.0.1, no token: allowed
	if c := abortAll(url, ""); c != 200 {
		t.Errorf("loopback without a token: %d", c)
	}
	stop()

	url, errb, stop := start("--host", "0.0.0.0")
	if c := abortAll(url, ""); c != 403 {
		t.Errorf("0.0.0.0 without a token: %d", c)
	}
	stop()
	if !strings.Contains(errb.String(), "admin API disabled") {
		t.Errorf("no warning at start-up: %s", errb.String())
	}
}
