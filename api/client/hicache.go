package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"

	"github.com/pdkit/pdkit/api/debug"
)

// OffloadHiCache moves the cached prefix of a prompt (req's text or token
// ids) to every rank's host tier (POST /admin/v1/hicache/offload), so that
// the next request with it loads it back from host. The answer says how
// many of the prompt's tokens the call moved (0 when none was cached on
// the device). The tier off, no prefix cache, or another offload waiting is an
// *APIError with status 409; a bad prompt one with status 400.
func (c *Client) OffloadHiCache(ctx context.Context, req debug.HiCacheOffloadRequest) (debug.HiCacheOffloadResponse, error) {
	var v debug.HiCacheOffloadResponse
	return v, c.postJSON(ctx, debug.HiCacheOffloadPath, true, req, &v)
}

// postJSON POSTs in as a JSON body to path and decodes a 2xx JSON answer
// into v (when not nil), failing as do does.
func (c *Client) postJSON(ctx context.Context, path string, admin bool, in, v any) error {
	body, err := json.Marshal(in)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout())
	defer cancel()
	u := c.BaseURL + path
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	if admin && c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := c.httpClient().Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("POST %s: %w", u, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return fmt.Errorf("POST %s: reading the answer: %w", u, err)
	}
	if resp.StatusCode/100 != 2 {
		return &APIError{URL: u, Status: resp.StatusCode, Message: errorMessage(answer)}
	}
	if v == nil {
		return nil
	}
	if err := json.Unmarshal(answer, v); err != nil {
		return fmt.Errorf("POST %s: decoding the answer: %w", u, err)
	}
	return nil
}
