package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
)

// streamed is a streamed response of n choices, put together per index.
type streamed struct {
	text    map[int]string
	finish  map[int]string
	role    map[int]int // chat: role deltas per index
	usage   *openai.Usage
	done    bool
	errText string
}

// readChoices reads an SSE stream of completion or chat chunks.
func readChoices(t *testing.T, resp *http.Response) streamed {
	t.Helper()
	res := streamed{text: map[int]string{}, finish: map[int]string{}, role: map[int]int{}}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			res.done = true
			continue
		}
		if strings.HasPrefix(data, `{"error":`) {
			res.errText = data
			continue
		}
		var c struct {
			Choices []struct {
				Index        int     `json:"index"`
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
				Delta        struct {
					Role    string `json:"role"`
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *openai.Usage `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("%v: %s", err, data)
		}
		if c.Usage != nil {
			res.usage = c.Usage
		}
		for _, ch := range c.Choices {
			res.text[ch.Index] += ch.Text + ch.Delta.Content
			if ch.Delta.Role != "" {
				res.role[ch.Index]++
			}
			if ch.FinishReason != nil {
				if _, dup := res.finish[ch.Index]; dup {
					t.Errorf("choice %d finished twice", ch.Index)
				}
				res.finish[ch.Index] = *ch.FinishReason
			}
		}
	}
	return res
}

func (e *env) streamChoices(t *testing.T, path string, body map[string]any) streamed {
	t.Helper()
	body = maps(body)
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	b, _ := json.Marshal(body)
	resp, err := e.ts.Client().Post(e.ts.URL+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	return readChoices(t, resp)
}

// n choices through both OpenAI APIs and /generate, streamed and not:
// greedy choices equal the single choice, seeded ones differ and repeat,
// usage counts the prompt once and every choice's tokens.
func TestChoices(t *testing.T) {
	e := newEnvModel(t, testmodel.Open(t, tinySpec), serve.Config{PageSize: 4, KVTokens: 1024, MaxRunning: 8, DisablePrefixCache: true})
	greedy := map[string]any{"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true}
	one := e.complete(t, greedy)
	before := e.eng.View().Snapshot().Totals.PromptTokens
	body := maps(greedy)
	body["n"] = 3
	r := e.complete(t, body)
	if len(r.Choices) != 3 {
		t.Fatalf("%d choices", len(r.Choices))
	}
	for i, c := range r.Choices {
		if c.Index != i || c.Text != one.Choices[0].Text || c.FinishReason != "length" {
			t.Errorf("choice %d: %+v, want %q", i, c, one.Choices[0].Text)
		}
	}
	if u := r.Usage; u.PromptTokens != one.Usage.PromptTokens || u.CompletionTokens != 3*8 || u.TotalTokens != u.PromptTokens+24 {
		t.Errorf("usage %+v", u)
	}
	if got := e.eng.View().Snapshot().Totals.PromptTokens - before; got != uint64(one.Usage.PromptTokens) {
		t.Errorf("%d prompt tokens admitted for 3 choices of a %d-token prompt", got, one.Usage.PromptTokens)
	}

	s := e.streamChoices(t, "/v1/completions", body)
	if !s.done || s.errText != "" || len(s.text) != 3 || s.usage == nil || s.usage.CompletionTokens != 24 {
		t.Fatalf("stream: %+v", s)
	}
	for i := range 3 {
		if s.text[i] != one.Choices[0].Text || s.finish[i] != "length" {
			t.Errorf("streamed choice %d: %q %q", i, s.text[i], s.finish[i])
		}
	}

	chat := map[string]any{"messages": []map[string]any{{"role": "user", "content": "hi"}}, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "n": 2}
	code, b := e.post(t, "/v1/chat/completions", chat)
	var cr openai.ChatCompletionResponse
	if code != 200 || json.Unmarshal(b, &cr) != nil || len(cr.Choices) != 2 {
		t.Fatalf("chat: %d %s", code, b)
	}
	for i, c := range cr.Choices {
		if c.Index != i || c.Message.Content != cr.Choices[0].Message.Content || c.FinishReason != "length" {
			t.Errorf("chat choice %d: %+v", i, c)
		}
	}
	cs := e.streamChoices(t, "/v1/chat/completions", chat)
	for i := range 2 {
		if cs.text[i] != cr.Choices[0].Message.Content || cs.finish[i] != "length" || cs.role[i] != 1 {
			t.Errorf("streamed chat choice %d: %q %q roles %d", i, cs.text[i], cs.finish[i], cs.role[i])
		}
	}
	if !cs.done || cs.usage == nil || cs.usage.CompletionTokens != 12 {
		t.Errorf("streamed chat: %+v", cs)
	}

	seeded := map[string]any{"prompt": prompt, "max_tokens": 8, "temperature": 1.5, "seed": 4, "ignore_eos": true, "n": 4}
	a, a2 := e.complete(t, seeded), e.complete(t, seeded)
	distinct := map[string]bool{}
	for i := range a.Choices {
		distinct[a.Choices[i].Text] = true
		if a.Choices[i].Text != a2.Choices[i].Text {
			t.Errorf("seeded choice %d: %q then %q", i, a.Choices[i].Text, a2.Choices[i].Text)
		}
	}
	if len(distinct) < 2 {
		t.Errorf("seeded choices all equal: %+v", a.Choices)
	}

	code, b = e.post(t, "/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": 8, "temperature": 0, "ignore_eos": true, "n": 2}})
	var gs []GenerateResponse
	if code != 200 || json.Unmarshal(b, &gs) != nil || len(gs) != 2 {
		t.Fatalf("generate: %d %s", code, b)
	}
	for i, g := range gs {
		if g.Text != one.Choices[0].Text || g.MetaInfo.CompletionTokens != 8 {
			t.Errorf("generate %d: %+v", i, g)
		}
	}
	for _, c := range []struct {
		path string
		body map[string]any
		want string
	}{
		{"/v1/completions", map[string]any{"prompt": prompt, "n": 17}, `must be at most 16, got 17`},
		{"/v1/completions", map[string]any{"prompt": prompt, "n": 2, "best_of": 2}, `best_of`},
		{"/generate", map[string]any{"text": prompt, "sampling_params": map[string]any{"n": 0}}, `sampling_params.n`},
	} {
		if code, b := e.post(t, c.path, c.body); code != 400 || !strings.Contains(string(b), c.want) {
			t.Errorf("%s %v: %d %s", c.path, c.body, code, b)
		}
	}
	waitPoolsFree(t, e.eng)
}

// A stop string ends its own choice only; a client that goes ends every
// choice and frees the KV.
func TestChoicesStopAndDisconnect(t *testing.T) {
	e := newEnvModel(t, testmodel.Open(t, tinySpec), serve.Config{PageSize: 4, KVTokens: 2048, MaxRunning: 8})
	seeded := map[string]any{"prompt": prompt, "max_tokens": 24, "temperature": 1.5, "seed": 4, "ignore_eos": true, "n": 3}
	r := e.complete(t, seeded)
	// A stop string taken from choice 0's text stops choice 0 early.
	t0 := r.Choices[0].Text
	if len(t0) < 4 {
		t.Skipf("choice 0 too short: %q", t0)
	}
	stop := t0[len(t0)/2 : len(t0)/2+2]
	body := maps(seeded)
	body["stop"] = stop
	rs := e.complete(t, body)
	if rs.Choices[0].FinishReason != "stop" || strings.Contains(rs.Choices[0].Text, stop) {
		t.Errorf("choice 0 with stop %q: %+v", stop, rs.Choices[0])
	}
	for i, c := range rs.Choices {
		if !strings.Contains(r.Choices[i].Text, stop) && (c.Text != r.Choices[i].Text || c.FinishReason != "length") {
			t.Errorf("choice %d without the stop string: %+v, was %+v", i, c, r.Choices[i])
		}
	}

	before := disconnectAfter(t, e, map[string]any{"prompt": prompt, "max_tokens": 400, "ignore_eos": true, "stream": true, "n": 3}, 6)
	waitPoolsFree(t, e.eng)
	if got := e.eng.View().Snapshot().Totals.Aborts - before; got != 3 {
		t.Errorf("%d aborts, want the 3 choices", got)
	}
}

// PD: the decode answers n choices from one transfer; greedy choices
// equal the colocated answer.
func TestChoicesPD(t *testing.T) {
	cfg := serve.Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 8}
	pe, de, registry := newPDServers(t, cfg)
	col := newEnvModel(t, testmodel.Open(t, tinySpec), serve.Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 8})
	greedy := map[string]any{"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true}
	want := col.complete(t, greedy).Choices[0].Text
	for k, stream := range []bool{false, true} {
		body := maps(greedy)
		body["n"] = 3
		body["bootstrap_room"] = 700 + k
		body["bootstrap_url"] = registry
		perr := make(chan error, 1)
		go func() {
			pbody := maps(body)
			delete(pbody, "bootstrap_url")
			_, err := pe.completeErr("/v1/completions", pbody)
			perr <- err
		}()
		var texts map[int]string
		if stream {
			s := de.streamChoices(t, "/v1/completions", body)
			if !s.done || s.usage == nil || s.usage.CompletionTokens != 18 {
				t.Errorf("PD stream: %+v", s)
			}
			texts = s.text
		} else {
			code, b := de.post(t, "/v1/completions", body)
			var r openai.CompletionResponse
			if code != 200 || json.Unmarshal(b, &r) != nil {
				t.Fatalf("decode: %d %s", code, b)
			}
			texts = map[int]string{}
			for _, c := range r.Choices {
				texts[c.Index] = c.Text
			}
			if r.Usage.CompletionTokens != 18 {
				t.Errorf("PD usage %+v", r.Usage)
			}
		}
		if err := <-perr; err != nil {
			t.Fatalf("prefill: %v", err)
		}
		if len(texts) != 3 {
			t.Errorf("PD: %d choices", len(texts))
		}
		for i, x := range texts {
			if x != want {
				t.Errorf("PD choice %d: %q, colocated %q", i, x, want)
			}
		}
	}
	if pe.eng.PD().TransferBytes() != de.eng.PD().TransferBytes() {
		t.Errorf("transfer bytes: prefill %d, decode %d", pe.eng.PD().TransferBytes(), de.eng.PD().TransferBytes())
	}
	waitPoolsFree(t, pe.eng)
	waitPoolsFree(t, de.eng)
}
