package abtest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/openai"
)

// endpoint answers completion requests as the test scripts it, by the
// prompt's first token id; it records the bodies it got. It stands for a
// server only to show how Complete reads each kind of answer; the commands'
// tests run the real cluster.
type endpoint struct {
	mu     sync.Mutex
	bodies []map[string]any
	tries  map[int]int
}

func (e *endpoint) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body map[string]any
	b, _ := io.ReadAll(r.Body)
	json.Unmarshal(b, &body)
	first := int(body["prompt"].([]any)[0].(float64))
	e.mu.Lock()
	e.bodies = append(e.bodies, body)
	e.tries[first]++
	try := e.tries[first]
	e.mu.Unlock()
	chunk := func(text string, finish string) {
		c := openai.CompletionChunk{Object: openai.ObjectTextCompletion, Choices: []openai.CompletionChunkChoice{{Text: text}}}
		if finish != "" {
			c.Choices[0].FinishReason = &finish
		}
		openai.WriteEvent(w, c)
	}
	usage := func(n int) {
		openai.WriteEvent(w, openai.CompletionChunk{Object: openai.ObjectTextCompletion, Choices: []openai.CompletionChunkChoice{}, Usage: &openai.Usage{CompletionTokens: n}})
	}
	switch first {
	case 1: // three tokens, then the finish
		w.Header().Set("Content-Type", "text/event-stream")
		for _, s := range []string{"a", "b", "c"} {
			chunk(s, "")
			// Real time between the outputs: the latencies under test
			// are measured on the wall clock and must add up to it.
			time.Sleep(2 * time.Millisecond)
		}
		chunk("", "length")
		usage(3)
		openai.WriteDone(w)
	case 2: // refused at the edge once, then served
		if try == 1 {
			w.Header().Set("Retry-After", "0")
			http.Error(w, `{"error": {"message": "busy"}}`, http.StatusTooManyRequests)
			return
		}
		chunk("x", "length")
		usage(1)
		openai.WriteDone(w)
	case 3: // a bad request
		openai.InvalidRequest("no_cache", "no").WriteJSON(w)
	case 4: // cut by the server's timeout
		chunk("a", "")
		openai.WriteEvent(w, openai.ServerError("the request timed out in the server").Body())
		chunk("", "abort")
		openai.WriteDone(w)
	case 5: // aborted
		chunk("a", "")
		openai.WriteEvent(w, openai.ServerError("the request was aborted in the server").Body())
		chunk("", "abort")
		openai.WriteDone(w)
	case 6: // the stream ends before [DONE]
		chunk("a", "")
	case 7: // too slow for the client
		chunk("a", "")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	case 8: // stopped early
		chunk("a", "stop")
		usage(1)
		openai.WriteDone(w)
	}
}

// Complete reads each kind of answer into its outcome: the output, a
// timeout (the client's or the server's), or the failure's class; a 429 is
// sent again.
func TestComplete(t *testing.T) {
	e := &endpoint{tries: map[int]int{}}
	ts := httptest.NewServer(e)
	defer ts.Close()
	c := &Client{URL: ts.URL, MaxTokens: 3, Timeout: 500 * time.Millisecond}
	tests := []struct {
		first int
		want  string
	}{
		{1, `text "abc" finish "length" tokens 3 timeout false kind "" err ""`},
		{2, `text "x" finish "length" tokens 1 timeout false kind "" err ""`},
		{3, `text "" finish "" tokens 0 timeout false kind "http 400" err "400 no"`},
		{4, `text "a" finish "abort" tokens 0 timeout true kind "" err "the request timed out in the server"`},
		{5, `text "a" finish "abort" tokens 0 timeout false kind "error event" err "the request was aborted in the server"`},
		{6, `text "a" finish "" tokens 0 timeout false kind "stream cut" err "the stream ended before [DONE]"`},
		{7, `text "a" finish "" tokens 0 timeout true kind "" err "context deadline exceeded"`},
		{8, `text "a" finish "stop" tokens 1 timeout false kind "finish stop" err "finished \"stop\" after 1 tokens, want \"length\""`},
	}
	for _, tc := range tests {
		o := c.Complete(context.Background(), openai.Prompt{Tokens: []int{tc.first, 20}}, tc.first == 1)
		got := fmt.Sprintf("text %q finish %q tokens %d timeout %v kind %q err %q", o.Text, o.Finish, o.Tokens, o.Timeout, o.Kind, o.Err)
		if got != tc.want {
			t.Errorf("prompt %d:\n got %s\nwant %s", tc.first, got, tc.want)
		}
		// The server sleeps 2ms after each output, so the last comes at
		// least 4ms after the request: the times must add up to that,
		// however the client's reads were scheduled in between.
		if tc.first == 1 && (o.TTFT <= 0 || len(o.Gaps) != 2 || o.TTFT+o.Gaps[0]+o.Gaps[1] < 4*time.Millisecond) {
			t.Errorf("prompt 1: TTFT %v, gaps %v; want two gaps, the three adding up to 4ms or more", o.TTFT, o.Gaps)
		}
	}
	if e.tries[2] != 2 {
		t.Errorf("the 429 was sent %d times, want 2", e.tries[2])
	}
	// The body: greedy, EOS ignored, streamed with usage; no_cache only
	// when asked.
	b, _ := json.Marshal(e.bodies[0])
	if want := `{"ignore_eos":true,"max_tokens":3,"no_cache":true,"prompt":[1,20],"stream":true,"stream_options":{"include_usage":true},"temperature":0}`; string(b) != want {
		t.Errorf("body %s\nwant %s", b, want)
	}
	if _, ok := e.bodies[1]["no_cache"]; ok {
		t.Errorf("no_cache sent unasked: %v", e.bodies[1])
	}
}

// Run gives every session its conversations in turn and every turn its
// outcome in place; Compare counts what differs from the references.
func TestRunCompare(t *testing.T) {
	e := &endpoint{tries: map[int]int{}}
	ts := httptest.NewServer(e)
	defer ts.Close()
	c := &Client{URL: ts.URL, MaxTokens: 3, Timeout: 500 * time.Millisecond}
	s := Script{Convs: [][]openai.Prompt{
		{{Tokens: []int{1}}, {Tokens: []int{1, 2}}},
		{{Tokens: []int{3}}},
		{{Tokens: []int{1, 3}}, {Tokens: []int{4}}, {Tokens: []int{1, 5}}},
	}}
	var mu sync.Mutex
	seen := 0
	outs := Run(context.Background(), c, s, 2, false, func(int, int, Outcome) { mu.Lock(); seen++; mu.Unlock() })
	if seen != 6 || len(outs) != 3 || len(outs[0]) != 2 || len(outs[1]) != 1 || len(outs[2]) != 3 {
		t.Fatalf("%d done calls, outcomes %v", seen, outs)
	}
	refs := [][]Outcome{
		{{Text: "abc", Tokens: 3}, {Text: "abc", Tokens: 3}},
		{{Text: "abc", Tokens: 3}},
		{{Text: "abd", Tokens: 3}, {Text: "a", Tokens: 1}, {Text: "abc", Tokens: 2}},
	}
	cell := Compare(Cell{IndexK: "bf16", HiCache: "on"}, outs, refs)
	want := `{bf16 on 6 4 2 0.500 1 1 map[http 400:1] conversation 3 turn 1 conversation 2 turn 1: 400 no}`
	got := fmt.Sprintf("{%s %s %d %d %d %.3f %d %d %v %s %s}", cell.IndexK, cell.HiCache, cell.Requests, cell.Compared, cell.Corrupt, cell.CorruptShare,
		cell.Timeouts, cell.Errors, cell.ErrorKinds, cell.FirstCorrupt, cell.FirstError)
	if got != want {
		t.Errorf("Compare = %s\nwant %s", got, want)
	}
	if cell.TTFTMS.P50 <= 0 || cell.TTFTMS.P99 < cell.TTFTMS.P50 || cell.ITLMS.P50 < 1 {
		t.Errorf("latencies: TTFT %+v, ITL %+v", cell.TTFTMS, cell.ITLMS)
	}

	// Canceled: what was not sent says so.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	outs = Run(ctx, c, s, 1, false, nil)
	if o := outs[2][2]; o.Kind != "canceled" {
		t.Errorf("after the cancel: %+v", o)
	}
}

func TestPercentiles(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	if p := percentiles(ds); p != (Percentiles{P50: 50, P99: 99}) {
		t.Errorf("percentiles of 1..100ms = %+v", p)
	}
	if p := percentiles(ds[99:]); p != (Percentiles{P50: 1, P99: 1}) {
		t.Errorf("percentiles of 1ms = %+v", p)
	}
	if p := percentiles(nil); p != (Percentiles{}) {
		t.Errorf("percentiles of none = %+v", p)
	}
}
