package client

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// Pause pauses a router's admission (POST /admin/v1/pause): new requests
// wait at its edge until Resume or the lease's end. The call waits up to
// drain for the requests already in flight to end; the answer says how
// many are left.
func (c *Client) Pause(ctx context.Context, drain, lease time.Duration) (debug.PauseResponse, error) {
	var v debug.PauseResponse
	q := url.Values{"drain": {drain.String()}, "lease": {lease.String()}}
	return v, c.doWithin(ctx, c.timeout()+max(drain, 0), http.MethodPost, debug.PausePath+"?"+q.Encode(), true, &v)
}

// Resume resumes a router's admission (POST /admin/v1/resume).
func (c *Client) Resume(ctx context.Context) (debug.ResumeResponse, error) {
	var v debug.ResumeResponse
	return v, c.do(ctx, http.MethodPost, debug.ResumePath, true, &v)
}

// RouterReady reads a router's GET /readyz: its verdict and what it was
// judged on, whether ready (200) or not (503).
func (c *Client) RouterReady(ctx context.Context) (debug.RouterReady, error) {
	var v debug.RouterReady
	err := c.GetJSON(ctx, "/readyz", &v)
	var ae *APIError
	if errors.As(err, &ae) && ae.Status == http.StatusServiceUnavailable && ae.body != nil {
		if jerr := json.Unmarshal(ae.body, &v); jerr == nil && v.Status != "" {
			return v, nil
		}
	}
	return v, err
}
