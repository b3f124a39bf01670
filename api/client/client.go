// Package client is a small Go client for a pdkit server or router: the
// read-only debug API (GET /debug/v1/...) into the api/debug types, the
// server's self-description (GET /pd/v1/info), /health, the admin calls
// (POST /admin/v1/...: faults on and off, the host tier on, off, its
// pacing and the offload of a prompt's prefix, the index-K precision,
// abort by request id, by room, all)
// with an optional bearer token, cluster discovery through a router
// (GET /debug/v1/cluster), and GET /metrics with ParseMetrics to read its
// samples (pdctl reads the router's request outcomes so).
//
// Every call takes a context and is bounded by the client's Timeout on top
// of it. Failures are error values: *APIError for an answer with an error
// status, a wrapped transport error for a server that cannot be reached.
// Each fans a call out to several servers and returns one result per
// server, so that an unreachable server is a value next to the others'
// answers.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
)

// DefaultTimeout bounds one call when Client.Timeout is zero.
const DefaultTimeout = 5 * time.Second

// maxBody bounds the answers read.
const maxBody = 64 << 20

// Client talks to one pdkit server or router. The zero Timeout means
// DefaultTimeout; a nil HTTP means a client without proxies. A Client is
// safe for concurrent use.
type Client struct {
	// BaseURL is the server's base URL (http://host:port), without a
	// trailing slash.
	BaseURL string
	// Token, when set, is sent as "Authorization: Bearer <Token>" on the
	// admin calls.
	Token   string
	Timeout time.Duration
	HTTP    *http.Client
}

// New returns a client of the server at base with the default timeout.
func New(base, token string, hc *http.Client) *Client {
	return &Client{BaseURL: strings.TrimRight(base, "/"), Token: token, HTTP: hc}
}

var defaultHTTP = &http.Client{Transport: &http.Transport{
	Proxy:               nil, // the servers are the cluster's own
	DialContext:         (&net.Dialer{Timeout: 3 * time.Second}).DialContext,
	MaxIdleConnsPerHost: 4,
	IdleConnTimeout:     30 * time.Second,
}}

// APIError is an answer with a status outside 2xx.
type APIError struct {
	URL     string
	Status  int
	Message string // the OpenAI-style error body's message, else the body

	body []byte // the answer's body, for a call that reads it anyway
}

func (e *APIError) Error() string {
	return fmt.Sprintf("%s: %d %s", e.URL, e.Status, e.Message)
}

// StatusOf returns the HTTP status of an *APIError in err's chain, else 0.
func StatusOf(err error) int {
	var ae *APIError
	if errors.As(err, &ae) {
		return ae.Status
	}
	return 0
}

func (c *Client) httpClient() *http.Client {
	if c.HTTP != nil {
		return c.HTTP
	}
	return defaultHTTP
}

func (c *Client) timeout() time.Duration {
	if c.Timeout > 0 {
		return c.Timeout
	}
	return DefaultTimeout
}

// do sends one call and decodes a 2xx JSON answer into v (when not nil).
func (c *Client) do(ctx context.Context, method, path string, admin bool, v any) error {
	return c.doWithin(ctx, c.timeout(), method, path, admin, v)
}

// doWithin is do bounded by within instead of the client's timeout.
func (c *Client) doWithin(ctx context.Context, within time.Duration, method, path string, admin bool, v any) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	u := c.BaseURL + path
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return err
	}
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
		return fmt.Errorf("%s %s: %w", method, u, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return fmt.Errorf("%s %s: reading the answer: %w", method, u, err)
	}
	if resp.StatusCode/100 != 2 {
		return &APIError{URL: u, Status: resp.StatusCode, Message: errorMessage(body), body: body}
	}
	if v == nil {
		return nil
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("%s %s: decoding the answer: %w", method, u, err)
	}
	return nil
}

// errorMessage extracts the message of an OpenAI-style error body, or a
// health answer's reason, else returns the body as text.
func errorMessage(body []byte) string {
	var e struct {
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
		Reason string `json:"reason"`
	}
	if json.Unmarshal(body, &e) == nil {
		if e.Error != nil && e.Error.Message != "" {
			return e.Error.Message
		}
		if e.Reason != "" {
			return e.Reason
		}
	}
	return strings.TrimSpace(string(bytes.ToValidUTF8(body, []byte("?"))))
}

// GetJSON decodes the answer of GET path (with its query) into v.
func (c *Client) GetJSON(ctx context.Context, path string, v any) error {
	return c.do(ctx, http.MethodGet, path, false, v)
}

func withQueue(path, key, value string) string {
	if value == "" {
		return path
	}
	return path + "?" + key + "=" + url.QueryEscape(value)
}

// Info is the server's self-description (GET /pd/v1/info).
func (c *Client) Info(ctx context.Context) (pdproto.ServerInfo, error) {
	var v pdproto.ServerInfo
	return v, c.GetJSON(ctx, pdproto.InfoPath, &v)
}

// Health asks GET /health: nil when the server is healthy, an *APIError
// whose Message is the reason when it answers 503, another error when it
// cannot be reached.
func (c *Client) Health(ctx context.Context) error {
	return c.GetJSON(ctx, "/health", nil)
}

// State is GET /debug/v1/state: the model, the settings, rank 0's last
// step and the engine's last snapshot.
func (c *Client) State(ctx context.Context) (debug.StateResponse, error) {
	var v debug.StateResponse
	return v, c.GetJSON(ctx, debug.StatePath, &v)
}

// Settings is GET /debug/v1/settings: the server's effective settings (its
// timeouts, heartbeat, fault switches on, TP size, ...). A server too old
// to publish them answers an *APIError with status 404.
func (c *Client) Settings(ctx context.Context) (debug.Settings, error) {
	var v debug.Settings
	return v, c.GetJSON(ctx, debug.SettingsPath, &v)
}

// Steps is GET /debug/v1/steps.
func (c *Client) Steps(ctx context.Context) (debug.StepsResponse, error) {
	var v debug.StepsResponse
	return v, c.GetJSON(ctx, "/debug/v1/steps", &v)
}

// Collectives is GET /debug/v1/collectives.
func (c *Client) Collectives(ctx context.Context) (debug.CollectivesResponse, error) {
	var v debug.CollectivesResponse
	return v, c.GetJSON(ctx, "/debug/v1/collectives", &v)
}

// Requests is GET /debug/v1/requests, only queue's requests when queue is
// not empty.
func (c *Client) Requests(ctx context.Context, queue string) (debug.RequestsResponse, error) {
	var v debug.RequestsResponse
	return v, c.GetJSON(ctx, withQueue("/debug/v1/requests", "queue", queue), &v)
}

// PD is GET /debug/v1/pd, only queue's entries when queue is not empty. A
// colocated server answers an *APIError with status 404.
func (c *Client) PD(ctx context.Context, queue string) (debug.PDResponse, error) {
	var v debug.PDResponse
	return v, c.GetJSON(ctx, withQueue(debug.PDPath, "queue", queue), &v)
}

// Decisions is GET /debug/v1/decisions: every rank's decision log, only
// the records of steps after since when since is not 0. A server too old
// to keep one answers an *APIError with status 404.
func (c *Client) Decisions(ctx context.Context, since uint64) (debug.DecisionsResponse, error) {
	path := debug.DecisionsPath
	if since > 0 {
		path += "?since=" + strconv.FormatUint(since, 10)
	}
	var v debug.DecisionsResponse
	return v, c.GetJSON(ctx, path, &v)
}

// Faults is GET /debug/v1/faults.
func (c *Client) Faults(ctx context.Context) (debug.FaultsResponse, error) {
	var v debug.FaultsResponse
	return v, c.GetJSON(ctx, "/debug/v1/faults", &v)
}

// GPU is GET /debug/v1/gpu.
func (c *Client) GPU(ctx context.Context) (debug.GPUResponse, error) {
	var v debug.GPUResponse
	return v, c.GetJSON(ctx, debug.GPUPath, &v)
}

// Stacks is GET /debug/v1/stacks (pprof debug=1 text), only rank's
// goroutines when rank >= 0.
func (c *Client) Stacks(ctx context.Context, rank int) (string, error) {
	path := "/debug/v1/stacks"
	if rank >= 0 {
		path += "?rank=" + strconv.Itoa(rank)
	}
	return c.getText(ctx, path)
}

// Metrics is GET /metrics: the Prometheus text exposition.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	return c.getText(ctx, "/metrics")
}

// getText returns the body of a 2xx answer to GET path as text.
func (c *Client) getText(ctx context.Context, path string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+path, nil)
	if err != nil {
		return "", err
	}
	resp, err := c.httpClient().Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return "", fmt.Errorf("GET %s: %w", c.BaseURL+path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return "", err
	}
	if resp.StatusCode/100 != 2 {
		return "", &APIError{URL: c.BaseURL + path, Status: resp.StatusCode, Message: errorMessage(body)}
	}
	return string(body), nil
}

// Cluster is a router's GET /debug/v1/cluster: the servers behind it.
func (c *Client) Cluster(ctx context.Context) (debug.ClusterResponse, error) {
	var v debug.ClusterResponse
	return v, c.GetJSON(ctx, debug.ClusterPath, &v)
}

// SetFault switches fault name on or off (POST
// /admin/v1/faults/{name}/on|off) and returns every fault's state. A fault
// unknown or of another role is an *APIError with status 400.
func (c *Client) SetFault(ctx context.Context, name string, on bool) (debug.FaultsResponse, error) {
	state := "off"
	if on {
		state = "on"
	}
	var v debug.FaultsResponse
	return v, c.do(ctx, http.MethodPost, "/admin/v1/faults/"+url.PathEscape(name)+"/"+state, true, &v)
}

// HiCache is GET /debug/v1/hicache: every rank's host tier. A server
// too old to have one answers an *APIError with status 404.
func (c *Client) HiCache(ctx context.Context) (debug.HiCacheResponse, error) {
	var v debug.HiCacheResponse
	return v, c.GetJSON(ctx, debug.HiCachePath, &v)
}

// SetHiCache switches every rank's host tier on or off (POST
// /admin/v1/hicache/on|off) and returns the state after it; Pending says
// the loops had not taken it yet when the server answered (202). Another
// switch pending, too little host memory or no prefix cache on the server
// is an *APIError with status 409.
func (c *Client) SetHiCache(ctx context.Context, on bool) (debug.HiCacheSwitchResponse, error) {
	path := debug.HiCacheOffPath
	if on {
		path = debug.HiCacheOnPath
	}
	var v debug.HiCacheSwitchResponse
	return v, c.do(ctx, http.MethodPost, path, true, &v)
}

// SetHiCacheBandwidth paces every rank's loads back from host to
// bytesPerSecond, 0 unlimited (POST /admin/v1/hicache/bandwidth).
func (c *Client) SetHiCacheBandwidth(ctx context.Context, bytesPerSecond int64) (debug.HiCacheSwitchResponse, error) {
	var v debug.HiCacheSwitchResponse
	return v, c.do(ctx, http.MethodPost, debug.HiCacheBandwidthPath+"?bytes_per_second="+strconv.FormatInt(bytesPerSecond, 10), true, &v)
}

// SetIndexK switches the server's index-K precision live (POST
// /admin/v1/indexk/{fp8|bf16}?drain=D): the server drains, aborting what is
// still in flight after drain, and switches. The call waits for the switch,
// up to drain + debug.IndexKSwitchMargin on the server's side (the client's
// timeout is added on top of that); Pending says it was still under way
// when the server answered (202). A switch already under way is an
// *APIError with status 409; a model without a sparse indexer, or a
// precision or drain the server does not take, one with status 400.
func (c *Client) SetIndexK(ctx context.Context, dtype string, drain time.Duration) (debug.IndexKSwitchResponse, error) {
	var v debug.IndexKSwitchResponse
	path := debug.IndexKPath(url.PathEscape(dtype)) + "?drain=" + url.QueryEscape(drain.String())
	return v, c.doWithin(ctx, c.timeout()+max(drain, 0)+debug.IndexKSwitchMargin, http.MethodPost, path, true, &v)
}

// AbortRequest aborts request id (POST /admin/v1/requests/{id}/abort); an
// id in no queue is an *APIError with status 404.
func (c *Client) AbortRequest(ctx context.Context, id uint64) (debug.AbortResponse, error) {
	var v debug.AbortResponse
	return v, c.do(ctx, http.MethodPost, "/admin/v1/requests/"+strconv.FormatUint(id, 10)+"/abort", true, &v)
}

// AbortRoom aborts the live PD request of bootstrap room (POST
// /admin/v1/rooms/{room}/abort).
func (c *Client) AbortRoom(ctx context.Context, room uint64) (debug.AbortResponse, error) {
	var v debug.AbortResponse
	return v, c.do(ctx, http.MethodPost, "/admin/v1/rooms/"+strconv.FormatUint(room, 10)+"/abort", true, &v)
}

// AbortAll aborts every request of the server (POST /admin/v1/abort_all).
func (c *Client) AbortAll(ctx context.Context) (debug.AbortAllResponse, error) {
	var v debug.AbortAllResponse
	return v, c.do(ctx, http.MethodPost, "/admin/v1/abort_all", true, &v)
}

// Discover lists the servers behind the router at routerURL, prefill
// servers first, in the router's order.
func Discover(ctx context.Context, routerURL, token string, hc *http.Client) ([]debug.ClusterServer, error) {
	cr, err := New(routerURL, token, hc).Cluster(ctx)
	if err != nil {
		return nil, fmt.Errorf("discovering the cluster behind %s: %w", routerURL, err)
	}
	return cr.Servers, nil
}

// Result is one server's answer to a call fanned out by Each.
type Result[T any] struct {
	URL   string
	Value T
	Err   error
}

// Each calls call on every client at once and returns the results in the
// clients' order. A failed call is its result's Err; it never stops the
// others.
func Each[T any](ctx context.Context, clients []*Client, call func(context.Context, *Client) (T, error)) []Result[T] {
	out := make([]Result[T], len(clients))
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Go(func() {
			v, err := call(ctx, c)
			out[i] = Result[T]{URL: c.BaseURL, Value: v, Err: err}
		})
	}
	wg.Wait()
	return out
}

// VerifyModel rehashes the server's whole model file against its baseline
// (POST /admin/v1/model/verify); another verify under way is an *APIError
// with status 409.
func (c *Client) VerifyModel(ctx context.Context) (debug.ModelVerifyResponse, error) {
	var v debug.ModelVerifyResponse
	return v, c.doWithin(ctx, 10*time.Minute, http.MethodPost, debug.ModelVerifyPath, true, &v)
}
