package abtest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/openai"
)

// DefaultTimeout bounds one request, queueing included, when
// Client.Timeout is zero.
const DefaultTimeout = 3 * time.Minute

// Client sends a script's requests to one OpenAI endpoint (a router, or a
// colocated server): greedy, EOS ignored, MaxTokens each, streamed.
type Client struct {
	URL string // base URL, without a trailing slash
	// HTTP is the client the requests go through; nil: one without
	// proxies, made for the run.
	HTTP *http.Client
	// Timeout bounds one request end to end, waiting included (0:
	// DefaultTimeout). A request that runs out is a timeout.
	Timeout   time.Duration
	MaxTokens int
}

// NewHTTP is an HTTP client for sessions concurrent sessions against the
// cluster's own servers: no proxies, a connection per session kept.
func NewHTTP(sessions int) *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: max(sessions, 2),
		IdleConnTimeout:     30 * time.Second,
	}}
}

func (c *Client) timeout() time.Duration {
	if c.Timeout > 0 {
		return c.Timeout
	}
	return DefaultTimeout
}

// Outcome is how one request ended.
type Outcome struct {
	Text   string // the output
	Finish string // its finish reason
	Tokens int    // completion tokens, as the usage counted them
	// Timeout says the request ran out of the client's timeout, or the
	// server cut it for its own.
	Timeout bool
	// Kind and Err say why it failed, when it did (and did not time out):
	// Kind a short class ("http 503", "error event", "stream cut",
	// "finish abort", ...), Err the detail.
	Kind, Err string
	// TTFT is from sending the request to its first output, Gaps the
	// times between its streamed outputs.
	TTFT time.Duration
	Gaps []time.Duration
}

// Failed says the request has no output to compare.
func (o Outcome) Failed() bool { return o.Timeout || o.Kind != "" }

// request is the body of a completion request.
type request struct {
	Prompt        openai.Prompt         `json:"prompt"`
	MaxTokens     int                   `json:"max_tokens"`
	Temperature   float64               `json:"temperature"`
	IgnoreEOS     bool                  `json:"ignore_eos"`
	Stream        bool                  `json:"stream"`
	StreamOptions *openai.StreamOptions `json:"stream_options"`
	NoCache       bool                  `json:"no_cache,omitempty"`
}

// maxRetryAfter bounds the wait after a 429 (the router refusing excess
// work at the edge): the request is sent again until it is taken or its
// timeout runs out.
const maxRetryAfter = 2 * time.Second

// Complete sends prompt and reads the stream to its end. noCache asks the
// server to compute the whole prompt, reading nothing from its prefix
// cache or host tier (the pdkit extension no_cache).
func (c *Client) Complete(ctx context.Context, prompt openai.Prompt, noCache bool) Outcome {
	ctx, cancel := context.WithTimeout(ctx, c.timeout())
	defer cancel()
	body, err := json.Marshal(request{Prompt: prompt, MaxTokens: c.MaxTokens, IgnoreEOS: true, Stream: true,
		StreamOptions: &openai.StreamOptions{IncludeUsage: true}, NoCache: noCache})
	if err != nil {
		return Outcome{Kind: "request", Err: err.Error()}
	}
	hc := c.HTTP
	if hc == nil {
		hc = NewHTTP(1)
	}
	start := time.Now()
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.URL+"/v1/completions", bytes.NewReader(body))
		if err != nil {
			return Outcome{Kind: "request", Err: err.Error()}
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "text/event-stream")
		resp, err := hc.Do(req)
		if err != nil {
			return failed(ctx, "transport", err.Error())
		}
		if resp.StatusCode == http.StatusTooManyRequests {
			wait := retryAfter(resp.Header.Get("Retry-After"))
			io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			select {
			case <-ctx.Done():
				return failed(ctx, "http 429", "refused with 429 until the request's time ran out")
			case <-time.After(wait):
			}
			continue
		}
		o := c.read(ctx, resp, start)
		resp.Body.Close()
		return o
	}
}

// failed is the outcome of a request that ended with err: a timeout when
// its context ran out of time.
func failed(ctx context.Context, kind, err string) Outcome {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return Outcome{Timeout: true, Err: err}
	}
	if ctx.Err() != nil {
		return Outcome{Kind: "canceled", Err: err}
	}
	return Outcome{Kind: kind, Err: err}
}

// retryAfter reads a Retry-After in seconds, at most maxRetryAfter;
// 200ms when missing.
func retryAfter(v string) time.Duration {
	if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && n >= 0 {
		return min(time.Duration(n)*time.Second, maxRetryAfter)
	}
	return 200 * time.Millisecond
}

// read reads a completion answer: a stream to its [DONE], or an error body.
func (c *Client) read(ctx context.Context, resp *http.Response, start time.Time) Outcome {
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		msg := strings.TrimSpace(string(b))
		if e := openai.ParseError(resp.StatusCode, b); e != nil && e.Message != "" {
			msg = e.Message
		}
		return Outcome{Kind: fmt.Sprintf("http %d", resp.StatusCode), Err: fmt.Sprintf("%d %s", resp.StatusCode, msg)}
	}
	var o Outcome
	var text strings.Builder
	var last time.Time
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	done := false
	for !done && sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			done = true
			break
		}
		var ev struct {
			openai.CompletionChunk
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return Outcome{Kind: "bad event", Err: fmt.Sprintf("event %.200q: %v", data, err)}
		}
		now := time.Now()
		if ev.Error != nil {
			// The server cut the request; its finish chunk follows.
			if strings.Contains(ev.Error.Message, "timed out") {
				o.Timeout = true
			} else if o.Kind == "" {
				o.Kind = "error event"
			}
			o.Err = ev.Error.Message
			continue
		}
		for _, ch := range ev.Choices {
			if ch.Text != "" {
				if last.IsZero() {
					o.TTFT = now.Sub(start)
				} else {
					o.Gaps = append(o.Gaps, now.Sub(last))
				}
				last = now
				text.WriteString(ch.Text)
			}
			if ch.FinishReason != nil {
				o.Finish = *ch.FinishReason
				if last.IsZero() {
					o.TTFT = now.Sub(start)
				}
			}
		}
		if ev.Usage != nil {
			o.Tokens = ev.Usage.CompletionTokens
		}
	}
	o.Text = text.String()
	switch {
	case o.Failed():
	case !done:
		err := "the stream ended before [DONE]"
		if sc.Err() != nil {
			err = sc.Err().Error()
		}
		f := failed(ctx, "stream cut", err)
		o.Timeout, o.Kind, o.Err = f.Timeout, f.Kind, f.Err
	case o.Finish != openai.FinishLength:
		o.Kind, o.Err = "finish "+o.Finish, fmt.Sprintf("finished %q after %d tokens, want %q", o.Finish, o.Tokens, openai.FinishLength)
	}
	return o
}

// Run sends script over sessions concurrent sessions: session s runs
// conversations s, s+sessions, s+2×sessions, ..., each turn after the
// previous one has ended; out[c][t] is conversation c's turn t. A failed
// turn does not stop its conversation (the prompts are scripted). noCache
// is Complete's. done, when not nil, is called after every request (from
// the sessions' goroutines). Once ctx ends, the turns not yet sent are
// "canceled".
func Run(ctx context.Context, c *Client, s Script, sessions int, noCache bool, done func(conv, turn int, o Outcome)) [][]Outcome {
	out := make([][]Outcome, len(s.Convs))
	for i, conv := range s.Convs {
		out[i] = make([]Outcome, len(conv))
	}
	var wg sync.WaitGroup
	for w := range max(sessions, 1) {
		wg.Go(func() {
			for ci := w; ci < len(s.Convs); ci += max(sessions, 1) {
				for t, p := range s.Convs[ci] {
					var o Outcome
					if ctx.Err() != nil {
						o = Outcome{Kind: "canceled", Err: ctx.Err().Error()}
					} else {
						o = c.Complete(ctx, p, noCache)
					}
					out[ci][t] = o
					if done != nil {
						done(ci, t, o)
					}
				}
			}
		})
	}
	wg.Wait()
	return out
}
