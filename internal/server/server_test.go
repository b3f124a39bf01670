package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/runner"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/engine/tokenizer"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
	"github.com/pdkit/pdkit/kernels/cpu"
)

func TestMain(m *testing.M) { testmodel.Main(m) }

type env struct {
	m   *model.Model
	eng *serve.Engine
	srv *Server
	ts  *httptest.Server
}

func newEnv(t *testing.T) *env {
	t.Helper()
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	return newEnvModel(t, m, serve.Config{PageSize: 4, MaxRunning: 8})
}

// newEnvModel serves m with an engine of configuration cfg on a real HTTP
// server; both are closed with the test.
func newEnvModel(t *testing.T, m *model.Model, cfg serve.Config) *env {
	t.Helper()
	return newEnvModelOpts(t, m, cfg, Options{})
}

// newEnvModelOpts is newEnvModel with the server's options.
func newEnvModelOpts(t *testing.T, m *model.Model, cfg serve.Config, opts Options) *env {
	t.Helper()
	eng, err := serve.New(m, withCPU(cfg))
	if err != nil {
		t.Fatal(err)
	}
	// As pdserve does, a PD server holds the cluster's secret.
	opts.ModelName, opts.ClusterSecret = "tiny", cfg.PD.Secret
	srv := New(eng, m, opts)
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		eng.Close()
	})
	return &env{m: m, eng: eng, srv: srv, ts: ts}
}

func (e *env) post(t *testing.T, path string, body any) (int, []byte) {
	t.Helper()
	return e.send(t, path, body, nil)
}

// send posts body (a string as it is, anything else as JSON) to e's path;
// prepare, when set, sees the request and the body bytes before it goes.
func (e *env) send(t *testing.T, path string, body any, prepare func(*http.Request, []byte)) (int, []byte) {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case string:
		b = []byte(v)
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	req, err := http.NewRequest(http.MethodPost, e.ts.URL+path, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if prepare != nil {
		prepare(req, b)
	}
	resp, err := e.ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

func (e *env) complete(t *testing.T, body map[string]any) openai.CompletionResponse {
	t.Helper()
	code, b := e.post(t, "/v1/completions", body)
	if code != 200 {
		t.Fatalf("status %d: %s", code, b)
	}
	var r openai.CompletionResponse
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// streamResult is a streamed completion, put together.
type streamResult struct {
	text   string
	finish string
	usage  *openai.Usage
	chunks int
	done   bool
	err    string // the message of an error event
}

func readStream(t *testing.T, r io.Reader) streamResult {
	t.Helper()
	var res streamResult
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("bad SSE line %q", line)
		}
		if data == "[DONE]" {
			res.done = true
			continue
		}
		if res.done {
			t.Fatalf("event after [DONE]: %s", data)
		}
		var eb openai.ErrorBody
		if strings.HasPrefix(data, `{"error":`) && json.Unmarshal([]byte(data), &eb) == nil {
			res.err = eb.Error.Message
			continue
		}
		var c openai.CompletionChunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("%v: %s", err, data)
		}
		res.chunks++
		if c.Usage != nil {
			res.usage = c.Usage
			continue
		}
		for _, ch := range c.Choices {
			res.text += ch.Text
			if ch.FinishReason != nil {
				res.finish = *ch.FinishReason
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return res
}

func (e *env) stream(t *testing.T, body map[string]any) streamResult {
	t.Helper()
	body["stream"] = true
	b, _ := json.Marshal(body)
	resp, err := e.ts.Client().Post(e.ts.URL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Error(err)
		return streamResult{}
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		b, _ := io.ReadAll(resp.Body)
		t.Errorf("status %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
		return streamResult{}
	}
	return readStream(t, resp.Body)
}

const prompt = "Once upon a time there was a little robot"

func TestGreedyMatchesRunner(t *testing.T) {
	e := newEnv(t)
	const maxTok = 20
	ids, err := e.m.Tokenizer.Encode(prompt, true)
	if err != nil {
		t.Fatal(err)
	}
	rn, err := runner.New(e.m, cpu.New(1), runner.Options{PageSize: 4, KVTokens: 256})
	if err != nil {
		t.Fatal(err)
	}
	want, _, err := rn.Generate(context.Background(), []runner.Request{{Prompt: ids, MaxTokens: maxTok, Sampling: sample.Params{}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dec := tokenizer.NewStreamDecoder(e.m.Tokenizer)
	var wantText string
	for _, tok := range want[0].Tokens {
		if !e.m.Tokenizer.IsEOG(tok) {
			wantText += dec.Add(tok)
		}
	}
	wantText += dec.Flush()

	t.Logf("runner: %d tokens (%s), %q", len(want[0].Tokens), want[0].Finish, wantText)
	if wantText == "" {
		t.Fatal("the runner generated no text; pick another prompt")
	}
	got := e.complete(t, map[string]any{"model": "tiny", "prompt": prompt, "max_tokens": maxTok, "temperature": 0})
	if len(got.Choices) != 1 {
		t.Fatalf("choices %+v", got.Choices)
	}
	c := got.Choices[0]
	if c.Text != wantText || c.FinishReason != want[0].Finish {
		t.Errorf("got %q (%s), want %q (%s)", c.Text, c.FinishReason, wantText, want[0].Finish)
	}
	if got.Usage.PromptTokens != len(ids) || got.Usage.CompletionTokens != len(want[0].Tokens) ||
		got.Usage.TotalTokens != len(ids)+len(want[0].Tokens) {
		t.Errorf("usage %+v, want %d + %d", got.Usage, len(ids), len(want[0].Tokens))
	}
	if !strings.HasPrefix(got.ID, "cmpl-") || got.Model != "tiny" || got.Object != openai.ObjectTextCompletion {
		t.Errorf("response %+v", got)
	}

	// The native API agrees.
	code, b := e.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": maxTok, "temperature": 0}})
	var gr GenerateResponse
	if code != 200 || json.Unmarshal(b, &gr) != nil {
		t.Fatalf("/generate: %d %s", code, b)
	}
	if gr.Text != wantText || gr.MetaInfo.FinishReason != want[0].Finish || gr.MetaInfo.CompletionTokens != len(want[0].Tokens) ||
		gr.MetaInfo.PromptTokens != len(ids) {
		t.Errorf("/generate: %+v, want %q", gr, wantText)
	}
}

func TestStreamingAgrees(t *testing.T) {
	e := newEnv(t)
	for _, body := range []func() map[string]any{
		func() map[string]any { return map[string]any{"prompt": prompt, "max_tokens": 24, "temperature": 0} },
		func() map[string]any {
			return map[string]any{"prompt": "The sky", "max_tokens": 30, "temperature": 0.9, "seed": 5, "top_p": 0.9, "ignore_eos": true}
		},
	} {
		want := e.complete(t, body())
		b := body()
		b["stream_options"] = map[string]any{"include_usage": true}
		got := e.stream(t, b)
		w := want.Choices[0]
		if got.text != w.Text || got.finish != w.FinishReason || got.usage == nil || *got.usage != want.Usage || !got.done {
			t.Errorf("stream %+v (usage %v), want %q %s %+v", got, got.usage, w.Text, w.FinishReason, want.Usage)
		}
		// Without include_usage there is no usage chunk.
		if got := e.stream(t, body()); got.usage != nil || got.text != w.Text || !got.done {
			t.Errorf("stream without usage: %+v", got)
		}
	}
}

func TestStopStrings(t *testing.T) {
	e := newEnv(t)
	body := func() map[string]any {
		return map[string]any{"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true}
	}
	full := e.complete(t, body()).Choices[0].Text
	r := []rune(full)
	if len(r) < 12 {
		t.Skipf("generation too short: %q", full)
	}
	stop := string(r[6:9])
	cut := strings.Index(full, stop)
	for _, stream := range []bool{false, true} {
		b := body()
		b["stop"] = []string{"\x00never", stop}
		var text, finish string
		if stream {
			b["stream_options"] = map[string]any{"include_usage": true}
			s := e.stream(t, b)
			text, finish = s.text, s.finish
		} else {
			c := e.complete(t, b)
			text, finish = c.Choices[0].Text, c.Choices[0].FinishReason
			if c.Usage.CompletionTokens >= 40 {
				t.Errorf("usage %+v: the rest was not aborted", c.Usage)
			}
		}
		if text != full[:cut] || finish != openai.FinishStop {
			t.Errorf("stream=%v stop %q: got %q (%s), want %q", stream, stop, text, finish, full[:cut])
		}
	}
	if h := holdback("abc\u00e9x", []string{"xyz", "\u00e9xq"}); h != 3 {
		t.Errorf("holdback %d", h)
	}
}

func TestChat(t *testing.T) {
	e := newEnv(t)
	msgs := []map[string]any{{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}}
	code, b := e.post(t, "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 10, "temperature": 0})
	var r openai.ChatCompletionResponse
	if code != 200 || json.Unmarshal(b, &r) != nil {
		t.Fatalf("%d %s", code, b)
	}
	want, _ := ChatPrompt(e.m.Tokenizer, []openai.Message{
		{Role: "system", Content: openai.Content{Text: "Be brief."}}, {Role: "user", Content: openai.Content{Text: "Hi"}}})
	if !strings.HasPrefix(r.ID, "chatcmpl-") || r.Usage.PromptTokens != len(want) || r.Choices[0].Message.Role != "assistant" {
		t.Errorf("%+v", r)
	}
	// Streamed chat chunks carry the same content.
	bb, _ := json.Marshal(map[string]any{"messages": msgs, "max_tokens": 10, "temperature": 0, "stream": true})
	resp, err := e.ts.Client().Post(e.ts.URL+"/v1/chat/completions", "application/json", bytes.NewReader(bb))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var text, finish, role string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c openai.ChatCompletionChunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatal(err)
		}
		for _, ch := range c.Choices {
			text += ch.Delta.Content
			if ch.Delta.Role != "" {
				role = ch.Delta.Role
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
	}
	if text != r.Choices[0].Message.Content || finish != r.Choices[0].FinishReason || role != "assistant" {
		t.Errorf("stream %q %s %s, want %q %s", text, finish, role, r.Choices[0].Message.Content, r.Choices[0].FinishReason)
	}
}

// 64 concurrent streams all complete, and the greedy ones (every other)
// stream the text that the same request gets alone and not streamed.
func TestConcurrentStreams(t *testing.T) {
	e := newEnv(t)
	const streams = 64
	body := func(i int) map[string]any {
		b := map[string]any{"prompt": fmt.Sprintf("Story %d:", i), "max_tokens": 8, "seed": i}
		if i%2 == 0 {
			b["temperature"] = 0
		}
		return b
	}
	got := make([]result, streams)
	var wg sync.WaitGroup
	for i := range streams {
		wg.Go(func() {
			r, err := e.streamErr("/v1/completions", body(i))
			if err != nil || r.Finish == "" || r.Usage.CompletionTokens < 1 {
				t.Errorf("stream %d: %+v %v", i, r, err)
			}
			got[i] = r
		})
	}
	wg.Wait()
	waitPoolsFree(t, e.eng)
	for i := 0; i < streams; i += 2 {
		if want := e.complete(t, body(i)); got[i] != (result{want.Choices[0].Text, want.Choices[0].FinishReason, want.Usage}) {
			t.Errorf("stream %d: %+v, alone %+v", i, got[i], want)
		}
	}
}

// waitIdle waits until the engine holds no request and no KV page.
// ranksFree reports whether no rank's pool holds pages for a sequence
// (rank 0's snapshot says nothing of the others, which release in the
// same iteration but may publish a moment later).
func ranksFree(eng *serve.Engine) bool {
	for r := range eng.View().Ranks() {
		if used, cached, _ := eng.View().KVPages(r); used != cached {
			return false
		}
	}
	return true
}

func waitIdle(t *testing.T, eng *serve.Engine) {
	t.Helper()
	waitfor.NoError(t, "the engine idle", 20*time.Second, func() error {
		q := eng.View().Snapshot().Queue
		if q.HeldPages == 0 && len(q.Waiting)+len(q.Prefilling)+len(q.Running)+len(q.Aborting) == 0 && eng.View().Health(time.Now()).Pending == 0 && ranksFree(eng) {
			return nil
		}
		return fmt.Errorf("%+v", q)
	})
}

// disconnectAfter streams a completion of body, reads events data lines
// of it and goes away, as a client that disconnects mid-stream. It returns
// the engine's abort count from just before the disconnect.
func disconnectAfter(t *testing.T, e *env, body map[string]any, events int) (abortsBefore uint64) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, "POST", e.ts.URL+"/v1/completions", bytes.NewReader(b))
	resp, err := e.ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	for n := 0; n < events; {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(line, "data: ") {
			n++
		}
	}
	return e.eng.View().Snapshot().Totals.Aborts
}

func TestDisconnectFreesKV(t *testing.T) {
	e := newEnv(t)
	before := disconnectAfter(t, e, map[string]any{"prompt": prompt, "max_tokens": 200, "ignore_eos": true, "stream": true}, 2)
	waitIdle(t, e.eng)
	if s := e.eng.View().Snapshot(); s.Totals.Aborts <= before {
		t.Errorf("no abort counted: %+v", s.Totals)
	}
	// The server still serves.
	if r := e.complete(t, map[string]any{"prompt": "x", "max_tokens": 2}); len(r.Choices) != 1 {
		t.Errorf("%+v", r)
	}
}

func TestAbortRequest(t *testing.T) {
	// Loopback without a token: the admin rule lets /abort_request in.
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 8}, Options{Loopback: true})
	// As long as the context allows, so that the abort lands first even on
	// a loaded machine (200 tokens could all be out by then).
	b, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 480, "ignore_eos": true, "stream": true})
	resp, err := e.ts.Client().Post(e.ts.URL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	var c openai.CompletionChunk
	if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &c); err != nil {
		t.Fatal(err)
	}
	if code, body := e.post(t, "/abort_request", map[string]any{"rid": c.ID}); code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	// An abort is no failure: the stream ends with finish_reason "abort"
	// and [DONE], and no error event.
	r := readStream(t, rd)
	if r.finish != openai.FinishAbort || !r.done || r.err != "" {
		t.Errorf("after abort: %+v", r)
	}
	if code, _ := e.post(t, "/abort_request", map[string]any{"rid": "cmpl-x"}); code != 400 {
		t.Errorf("bad rid: %d", code)
	}
}

func TestBadInput(t *testing.T) {
	e := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 8}, Options{Loopback: true}) // /abort_request is under the admin rule
	ctxLen := e.m.Config.ContextLen
	long := strings.Repeat("robot ", ctxLen)
	for _, tc := range []struct {
		name, path string
		body       any
		status     int
		param      string
	}{
		{"malformed", "/v1/completions", `{"prompt": "x",`, 400, ""},
		{"not an object", "/v1/completions", `[1,2]`, 400, ""},
		{"wrong type", "/v1/completions", `{"prompt": "x", "max_tokens": "3"}`, 400, "max_tokens"},
		{"wrong type temperature", "/v1/completions", `{"prompt": "x", "temperature": true}`, 400, "temperature"},
		{"unknown model", "/v1/completions", map[string]any{"model": "gpt-9", "prompt": "x"}, 404, "model"},
		{"prompt too long", "/v1/completions", map[string]any{"prompt": long, "max_tokens": 4}, 400, "prompt"},
		{"prompt plus max_tokens", "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": ctxLen}, 400, "prompt"},
		{"max_tokens over limit", "/v1/completions", map[string]any{"prompt": "x", "max_tokens": ctxLen + 1}, 400, "max_tokens"},
		{"token out of vocab", "/v1/completions", map[string]any{"prompt": []int{1, 1 << 30}}, 400, "prompt"},
		{"chat malformed", "/v1/chat/completions", `{"messages": 3}`, 400, "messages"},
		{"chat unknown model", "/v1/chat/completions", map[string]any{"model": "m", "messages": []map[string]any{{"role": "user", "content": "hi"}}}, 404, "model"},
		{"chat too long", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": long}}}, 400, "prompt"},
		{"too large", "/v1/completions", `{"prompt": "` + strings.Repeat("a", 5<<20) + `"}`, 413, ""},
		{"generate malformed", "/generate", `{"text": 3}`, 400, "text"},
		{"generate bad max", "/generate", map[string]any{"text": "x", "sampling_params": map[string]any{"max_new_tokens": 0}}, 400, "sampling_params.max_new_tokens"},
		{"generate too long", "/generate", map[string]any{"text": long}, 400, "prompt"},
		{"abort malformed", "/abort_request", `{`, 400, ""},
		{"no route", "/v1/nothing", `{}`, 404, ""},
	} {
		code, b := e.post(t, tc.path, tc.body)
		oe := openai.ParseError(code, b)
		var body openai.ErrorBody
		if code != tc.status || json.Unmarshal(b, &body) != nil || body.Error.Message == "" || body.Error.Type == "" {
			t.Errorf("%s: %d %s, want %d", tc.name, code, b, tc.status)
			continue
		}
		if tc.param != "" && oe.Param != tc.param {
			t.Errorf("%s: param %q, want %q (%s)", tc.name, oe.Param, tc.param, b)
		}
	}
	resp, err := e.ts.Client().Get(e.ts.URL + "/v1/completions")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "POST" || !json.Valid(b) {
		t.Errorf("GET /v1/completions: %d %s", resp.StatusCode, b)
	}
	waitIdle(t, e.eng)
}

func TestPanicRecovered(t *testing.T) {
	e := newEnv(t)
	e.srv.mux.Handle("GET", "/test/panic", func(http.ResponseWriter, *http.Request) { panic("boom") })
	resp, err := e.ts.Client().Get(e.ts.URL + "/test/panic")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var body openai.ErrorBody
	if resp.StatusCode != 500 || json.Unmarshal(b, &body) != nil || body.Error.Type != openai.TypeServer {
		t.Errorf("%d %s", resp.StatusCode, b)
	}
}

func get(t *testing.T, e *env, path string) (int, []byte) {
	t.Helper()
	resp, err := e.ts.Client().Get(e.ts.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func TestInfoEndpoints(t *testing.T) {
	e := newEnv(t)
	code, b := get(t, e, "/v1/models")
	var ml openai.ModelList
	if code != 200 || json.Unmarshal(b, &ml) != nil || len(ml.Data) != 1 || ml.Data[0].ID != "tiny" {
		t.Errorf("models: %d %s", code, b)
	}
	var h HealthResponse
	code, b = get(t, e, "/health")
	if code != 200 || json.Unmarshal(b, &h) != nil || h.Status != HealthOK || h.PDQueues != nil || !bytes.Contains(b, []byte(`"queued":0`)) {
		t.Errorf("health: %d %s", code, b)
	}
	var st debug.StateResponse
	code, b = get(t, e, "/debug/v1/state")
	if code != 200 || json.Unmarshal(b, &st) != nil || st.Snapshot == nil || st.Settings.MaxRunning != 8 {
		t.Errorf("state: %d %s", code, b)
	}
	code, b = get(t, e, "/debug/v1/stacks")
	if code != 200 || !bytes.HasPrefix(b, []byte("goroutine profile:")) {
		t.Errorf("stacks: %d %.200s", code, b)
	}
	code, b = get(t, e, "/debug/v1/stacks?rank=0")
	if code != 200 || !bytes.HasPrefix(b, []byte("goroutine profile:")) || !bytes.Contains(b, []byte(`"rank":"0"`)) {
		t.Errorf("stacks rank 0: %d %s", code, b)
	}
	code, b = get(t, e, "/debug/v1/stacks?rank=7")
	if code != 200 || bytes.Count(b, []byte("\n")) != 1 {
		t.Errorf("stacks rank 7: %d %s", code, b)
	}
	if code, b = get(t, e, "/debug/v1/stacks?rank=x"); code != 400 {
		t.Errorf("stacks rank x: %d %s", code, b)
	}
	// A stalled loop is reported.
	stalled := New(e.eng, e.m, Options{StallAfter: time.Nanosecond})
	waitfor.NoError(t, "health reporting a loop stalled past 1ns", 10*time.Second, func() error {
		rec := httptest.NewRecorder()
		stalled.ServeHTTP(rec, httptest.NewRequest("GET", "/health", nil))
		if rec.Code != 503 || !strings.Contains(rec.Body.String(), "not iterated") {
			return fmt.Errorf("stalled health: %d %s", rec.Code, rec.Body)
		}
		return nil
	})
}

// FuzzRequests posts arbitrary bodies: every answer is a 200 or an
// OpenAI-style 4xx error, never a panic or a 5xx.
func FuzzRequests(f *testing.F) {
	for _, s := range []string{
		`{"prompt": "hi", "max_tokens": 3}`,
		`{"prompt": [1, 2, 3], "max_tokens": 2, "stream": true, "stop": ["a"]}`,
		`{"prompt": "x", "max_tokens": 99999}`,
		`{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}`,
		`{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "max_tokens": 2, "stream": true}`,
		`{"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}`,
		`{"rid": "cmpl-12"}`,
		`{`, `null`, `[]`, `{"prompt": null}`, `{"prompt": "", "max_tokens": 1}`,
	} {
		for _, p := range []byte{0, 1, 2, 3} {
			f.Add(p, s)
		}
	}
	m := testmodel.Open(f, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	eng, err := serve.New(m, withCPU(serve.Config{PageSize: 4, MaxRunning: 4}))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { eng.Close() })
	srv := New(eng, m, Options{ModelName: "tiny"})
	paths := []string{"/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"}
	f.Fuzz(func(t *testing.T, path byte, body string) {
		p := paths[int(path)%len(paths)]
		// Bound the work of one input.
		var probe map[string]any
		if json.Unmarshal([]byte(body), &probe) == nil {
			for _, k := range []string{"max_tokens", "max_completion_tokens"} {
				if v, ok := probe[k].(float64); ok && v > 16 && v <= float64(m.Config.ContextLen) {
					t.Skip()
				}
			}
			if sp, ok := probe["sampling_params"].(map[string]any); ok {
				if v, ok := sp["max_new_tokens"].(float64); ok && v > 16 {
					t.Skip()
				}
			}
		}
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, httptest.NewRequest("POST", p, strings.NewReader(body)))
		switch {
		case rec.Code == 200:
		case rec.Code >= 400 && rec.Code < 500:
			var eb openai.ErrorBody
			if json.Unmarshal(rec.Body.Bytes(), &eb) != nil || eb.Error.Message == "" {
				t.Errorf("%s %q: %d with body %s", p, body, rec.Code, rec.Body)
			}
		default:
			t.Errorf("%s %q: status %d: %s", p, body, rec.Code, rec.Body)
		}
	})
}
