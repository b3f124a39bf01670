package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

// syncBuffer is a bytes.Buffer safe for one writer and one reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestServe(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	var out, errb syncBuffer
	cmd := newRootCmd()
	cmd.SetArgs([]string{"serve", "--model", path, "--port", "0", "--threads", "1", "--model-name", "tiny", "--shutdown-timeout", "1ms"})
	cmd.SetOut(&out)
	cmd.SetErr(&errb)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()

	re := regexp.MustCompile(`on (http://[0-9.:]+)\n`)
	var url string
	for end := time.Now().Add(20 * time.Second); url == ""; time.Sleep(5 * time.Millisecond) {
		if m := re.FindStringSubmatch(errb.String()); m != nil {
			url = m[1]
		}
		select {
		case err := <-done:
			t.Fatalf("serve ended early: %v: %s", err, errb.String())
		default:
		}
		if time.Now().After(end) {
			t.Fatalf("no listening URL: %s", errb.String())
		}
	}
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
	// A stream in flight when the server shuts down is cut off.
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
		if err != nil {
			t.Fatalf("serve: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not shut down")
	}
	io.Copy(io.Discard, rd) // ends, one way or another
	if _, err := http.Get(url + "/health"); err == nil {
		t.Error("still answering after shutdown")
	}
}

func TestServeUsageErrors(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	for _, args := range [][]string{
		{"serve", "--model", path, "--port", "-1"},
		{"serve", "--model", path, "--backend", "ref"},
		{"serve", "--model", path, "--tp", "3"},
		{"serve", "--model", path, "--index-k", "fp4"},
		{"serve", "extra"},
	} {
		if _, stderr, code := run(t, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr)
		}
	}
}
