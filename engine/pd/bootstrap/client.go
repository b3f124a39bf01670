package bootstrap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/pdproto"
)

// Client defaults.
const (
	DefaultAttemptTimeout = 5 * time.Second
	DefaultMinBackoff     = 25 * time.Millisecond
	DefaultMaxBackoff     = 500 * time.Millisecond
)

// maxResponseBytes bounds an answer read from a registry.
const maxResponseBytes = 4 << 20

// Client talks to a bootstrap registry: decode servers look the prefill
// group up, prefill ranks register. The zero value is ready to use. A
// Client is safe for concurrent use once its fields are set.
//
// Retries: Lookup retries a 503 (not ready) and a failed attempt (no
// connection, a timeout, a 502/504 from a proxy) with exponential backoff
// and jitter from MinBackoff to MaxBackoff until its context ends; a
// server's Retry-After lengthens a wait up to MaxBackoff, never beyond.
// Register retries the same way on failed attempts and 5xx answers. A 4xx
// answer is final for both and returned at once as a *pdproto.BootstrapError.
type Client struct {
	// HTTP is the client to use; nil means a client of its own with no
	// overall timeout (each attempt has AttemptTimeout).
	HTTP *http.Client
	// AttemptTimeout bounds each request; zero means DefaultAttemptTimeout.
	AttemptTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait between attempts; zero means
	// DefaultMinBackoff and DefaultMaxBackoff.
	MinBackoff, MaxBackoff time.Duration
	// Secret signs registrations (a registry with a secret takes no other);
	// nil sends them unsigned.
	Secret *clusterauth.Secret
	// OnRetry, when set, is called after each attempt that will be retried,
	// with its 1-based number and its error (a *pdproto.BootstrapError for
	// a 503). Tests and logs use it; it must not block for long.
	OnRetry func(attempt int, err error)
}

var defaultHTTP = &http.Client{}

func (c *Client) http() *http.Client {
	if c.HTTP != nil {
		return c.HTTP
	}
	return defaultHTTP
}

// Lookup asks the registry at baseURL ("http://host:port") for the prefill
// group, waiting through 503s until every rank has registered or ctx ends.
// It returns the ranks ordered by rank, checked to be a whole group (ranks
// 0..tp_size-1, each valid). When ctx ends first the error wraps ctx.Err()
// and the last answer's error.
func (c *Client) Lookup(ctx context.Context, baseURL string) ([]pdproto.RankInfo, error) {
	url := strings.TrimSuffix(baseURL, "/") + pdproto.BootstrapRanksPath
	var resp pdproto.LookupResponse
	err := c.retry(ctx, "lookup "+url, func(status int) bool {
		return status == http.StatusServiceUnavailable || status == http.StatusBadGateway || status == http.StatusGatewayTimeout
	}, func(actx context.Context) (int, error) {
		return c.do(actx, http.MethodGet, url, nil, &resp)
	})
	if err != nil {
		return nil, err
	}
	if err := checkLookup(&resp); err != nil {
		return nil, fmt.Errorf("bootstrap: lookup %s: bad answer: %w", url, err)
	}
	return resp.Ranks, nil
}

// checkLookup verifies that a 200 lookup answer is a whole, valid group.
func checkLookup(resp *pdproto.LookupResponse) error {
	if !resp.Complete {
		return errors.New("complete is false")
	}
	if resp.TPSize < 1 || len(resp.Ranks) != resp.TPSize {
		return fmt.Errorf("tp_size %d with %d ranks", resp.TPSize, len(resp.Ranks))
	}
	for i, r := range resp.Ranks {
		if r.Rank != i {
			return fmt.Errorf("ranks[%d] is rank %d", i, r.Rank)
		}
		if r.TPSize != resp.TPSize {
			return fmt.Errorf("rank %d has tp_size %d, the group %d", i, r.TPSize, resp.TPSize)
		}
		if err := r.Validate(); err != nil {
			return fmt.Errorf("rank %d: %w", i, err)
		}
	}
	return nil
}

// Handshake looks the prefill group up and checks it against the decode
// side's layout: the ranks, or the lookup's error, or a
// *pdproto.IncompatibleError.
func (c *Client) Handshake(ctx context.Context, baseURL string, local pdproto.DecodeInfo) ([]pdproto.RankInfo, error) {
	ranks, err := c.Lookup(ctx, baseURL)
	if err != nil {
		return nil, err
	}
	if err := pdproto.CheckCompatible(local, ranks); err != nil {
		return nil, fmt.Errorf("bootstrap: prefill at %s: %w", baseURL, err)
	}
	return ranks, nil
}

// Register registers one prefill rank with the registry at baseURL,
// retrying failed attempts and 5xx answers until ctx ends. A refusal (4xx)
// is returned at once as a *pdproto.BootstrapError; the caller should
// treat it as fatal rather than serve unroutable.
func (c *Client) Register(ctx context.Context, baseURL string, info pdproto.RankInfo) (*pdproto.RegisterResponse, error) {
	url := strings.TrimSuffix(baseURL, "/") + pdproto.BootstrapRanksPath + "/" + strconv.Itoa(info.Rank)
	body, err := json.Marshal(pdproto.RegisterRequest{RankInfo: info})
	if err != nil {
		return nil, fmt.Errorf("bootstrap: register: %w", err)
	}
	var resp pdproto.RegisterResponse
	err = c.retry(ctx, "register "+url, func(status int) bool { return status >= 500 },
		func(actx context.Context) (int, error) {
			return c.do(actx, http.MethodPut, url, body, &resp)
		})
	if err != nil {
		return nil, err
	}
	return &resp, nil
}

// retry runs attempt until it succeeds, fails with a status that retryable
// refuses, or ctx ends. attempt returns the HTTP status (0 when no answer
// came) and its error.
func (c *Client) retry(ctx context.Context, what string, retryable func(status int) bool,
	attempt func(context.Context) (int, error)) error {
	minB, maxB := c.MinBackoff, c.MaxBackoff
	if minB <= 0 {
		minB = DefaultMinBackoff
	}
	if maxB <= 0 {
		maxB = DefaultMaxBackoff
	}
	maxB = max(maxB, minB)
	perAttempt := c.AttemptTimeout
	if perAttempt <= 0 {
		perAttempt = DefaultAttemptTimeout
	}
	backoff := minB
	var last error
	for n := 1; ; n++ {
		if err := ctx.Err(); err != nil {
			return giveUp(what, err, last)
		}
		actx, cancel := context.WithTimeout(ctx, perAttempt)
		status, err := attempt(actx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			if status == 0 && last != nil {
				err = last // the attempt failed for the deadline; the previous answer says more
			}
			return giveUp(what, ctx.Err(), err)
		}
		if status != 0 && !retryable(status) {
			return fmt.Errorf("bootstrap: %s: %w", what, err)
		}
		last = err
		if c.OnRetry != nil {
			c.OnRetry(n, err)
		}
		wait := backoff/2 + rand.N(backoff/2+1) // jitter in [backoff/2, backoff]
		var be *pdproto.BootstrapError
		if errors.As(err, &be) && be.RetryAfter > wait {
			wait = be.RetryAfter
		}
		wait = min(wait, maxB)
		backoff = min(backoff*2, maxB)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return giveUp(what, ctx.Err(), last)
		case <-t.C:
		}
	}
}

func giveUp(what string, ctxErr, last error) error {
	if last == nil {
		return fmt.Errorf("bootstrap: %s: %w", what, ctxErr)
	}
	return fmt.Errorf("bootstrap: %s: gave up: %w; last attempt: %w", what, ctxErr, last)
}

// do sends one request and decodes a 2xx answer into out. Any other answer
// is returned as a *pdproto.BootstrapError with its status.
func (c *Client) do(ctx context.Context, method, url string, body []byte, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
		c.Secret.SignRequest(req, body, time.Now(), RegistryTarget)
	}
	resp, err := c.http().Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes))
	if err != nil {
		return 0, fmt.Errorf("reading the answer: %w", err)
	}
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, parseError(resp, data)
	}
	if err := json.Unmarshal(data, out); err != nil {
		return resp.StatusCode, fmt.Errorf("bad JSON in a %d answer: %w", resp.StatusCode, err)
	}
	return resp.StatusCode, nil
}

// parseError turns an error answer into a *pdproto.BootstrapError; a body
// that is not an error body becomes the message.
func parseError(resp *http.Response, data []byte) *pdproto.BootstrapError {
	var b pdproto.BootstrapErrorBody
	if err := json.Unmarshal(data, &b); err != nil || b.Error.Code == "" {
		msg := strings.TrimSpace(string(data))
		if len(msg) > 200 {
			msg = msg[:200] + "..."
		}
		b.Error = pdproto.BootstrapError{Code: "http_" + strconv.Itoa(resp.StatusCode), Message: msg}
	}
	e := b.Error
	e.Status = resp.StatusCode
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
		e.RetryAfter = time.Duration(s) * time.Second
	}
	return &e
}
