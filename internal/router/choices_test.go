package router_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
)

// "n" goes through the router unchanged: a PD cluster answers n choices,
// streamed and not, each greedy choice equal to the single answer.
func TestChoicesThroughRouter(t *testing.T) {
	c := newCluster(t, tinyModel(t), serve.Config{PageSize: 4, KVTokens: 512, MaxRunning: 8})
	prompt := []int32{5, 9, 13, 2, 7, 11, 3}
	one, err := complete(context.Background(), c.client, c.router.URL, body(prompt, 6, false, nil))
	if err != nil || one.status != 200 {
		t.Fatalf("%+v %v", one, err)
	}
	resp, err := c.client.Post(c.router.URL+"/v1/completions", "application/json", bytes.NewReader(body(prompt, 6, false, map[string]any{"n": 3})))
	if err != nil {
		t.Fatal(err)
	}
	var r openai.CompletionResponse
	err = json.NewDecoder(resp.Body).Decode(&r)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || len(r.Choices) != 3 || r.Usage.CompletionTokens != 18 {
		t.Fatalf("%d %+v %v", resp.StatusCode, r, err)
	}
	for i, ch := range r.Choices {
		if ch.Index != i || ch.Text != one.text {
			t.Errorf("choice %d: %+v, want %q", i, ch, one.text)
		}
	}

	resp, err = c.client.Post(c.router.URL+"/v1/completions", "application/json", bytes.NewReader(body(prompt, 6, true, map[string]any{"n": 2})))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	texts, done := map[int]string{}, false
	var usage *openai.Usage
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		switch {
		case !ok:
		case data == "[DONE]":
			done = true
		default:
			var ch openai.CompletionChunk
			if err := json.Unmarshal([]byte(data), &ch); err != nil {
				t.Fatalf("%v: %s", err, data)
			}
			if ch.Usage != nil {
				usage = ch.Usage
			}
			for _, x := range ch.Choices {
				texts[x.Index] += x.Text
			}
		}
	}
	if resp.StatusCode != http.StatusOK || !done || usage == nil || usage.CompletionTokens != 12 || len(texts) != 2 {
		t.Fatalf("stream: %d done %v usage %+v texts %v", resp.StatusCode, done, usage, texts)
	}
	for i, x := range texts {
		if x != one.text {
			t.Errorf("streamed choice %d: %q, want %q", i, x, one.text)
		}
	}
}
