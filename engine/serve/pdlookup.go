package serve

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/kernels"
)

// A decode fetches only the bootstrap registries of its own cluster's
// prefill servers: a request's bootstrap_url comes from a client, and a
// decode that fetched any URL it was given would be a proxy into its
// network. The registries it may fetch are an allowlist
// (PDConfig.PrefillBootstrap, AllowPrefillBootstrap); what it learnt of
// them is kept in a bounded LRU; and what went wrong in a lookup is logged,
// never handed back to the client.

// ErrBootstrapURL is returned by Submit for a decode request whose
// bootstrap_url is not one of the decode's prefill registries: nothing is
// fetched for it.
var ErrBootstrapURL = errors.New("serve: bootstrap_url is not a prefill registry of this decode server")

// lookupClient fetches registries; it follows no redirect, which would take
// a lookup off the allowlist.
var lookupClient = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

// canonicalRegistry is the form a registry URL is compared in: scheme and
// host lower case, no trailing slash. It refuses what no registry URL has
// (another scheme, user info, a query or a fragment).
func canonicalRegistry(raw string) (string, error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	switch {
	case err != nil:
		return "", err
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("scheme %q: want http or https", u.Scheme)
	case u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "":
		return "", errors.New("want scheme://host:port[/path] and nothing else")
	}
	return strings.ToLower(u.Scheme) + "://" + strings.ToLower(u.Host) + strings.TrimRight(u.EscapedPath(), "/"), nil
}

// registries is a decode's allowlist and its bounded lookup cache.
type registries struct {
	mu      sync.Mutex
	allowed map[string]bool          // canonical URLs
	byURL   map[string]*list.Element // of *resolution, most recently used first in lru
	lru     *list.List
	size    int
	evicted atomic.Uint64 // lookups dropped to keep the cache within size
	refused atomic.Uint64 // requests refused for a bootstrap_url off the allowlist
}

func newRegistries(c PDConfig) (*registries, error) {
	r := &registries{allowed: map[string]bool{}, byURL: map[string]*list.Element{}, lru: list.New(), size: max(1, c.BootstrapCacheSize)}
	for _, u := range c.PrefillBootstrap {
		if err := r.allow(u); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// allow adds a registry to the allowlist.
func (r *registries) allow(raw string) error {
	u, err := canonicalRegistry(raw)
	if err != nil {
		return fmt.Errorf("prefill bootstrap URL %q: %w", raw, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.allowed[u] = true
	return nil
}

// admit returns the canonical form of a request's bootstrap_url, or
// ErrBootstrapURL (counted) when it is off the allowlist.
func (r *registries) admit(raw string) (string, error) {
	u, err := canonicalRegistry(raw)
	r.mu.Lock()
	ok := err == nil && r.allowed[u]
	r.mu.Unlock()
	if !ok {
		r.refused.Add(1)
		return "", ErrBootstrapURL
	}
	return u, nil
}

// get returns the cached resolution of u, marking it used; nil when none.
// r.mu is held.
func (r *registries) get(u string) *resolution {
	if el := r.byURL[u]; el != nil {
		r.lru.MoveToFront(el)
		return el.Value.(*resolution)
	}
	return nil
}

// put caches res under u, evicting the least recently used beyond size.
// r.mu is held.
func (r *registries) put(u string, res *resolution) {
	if el := r.byURL[u]; el != nil {
		el.Value = res
		r.lru.MoveToFront(el)
		return
	}
	r.byURL[u] = r.lru.PushFront(res)
	for r.lru.Len() > r.size {
		old := r.lru.Back()
		r.lru.Remove(old)
		delete(r.byURL, old.Value.(*resolution).url)
		r.evicted.Add(1)
	}
}

// clear forgets every lookup (the allowlist stays).
func (r *registries) clear() {
	r.mu.Lock()
	defer r.mu.Unlock()
	clear(r.byURL)
	r.lru.Init()
}

// forget drops what is known of url, so that the next request looks it up
// again (a prefill that restarted has new endpoints).
func (r *registries) forget(url string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if el := r.byURL[url]; el != nil && el.Value.(*resolution).done {
		r.lru.Remove(el)
		delete(r.byURL, url)
	}
}

// resolution is one prefill registry as the decode side knows it.
type resolution struct {
	url   string
	done  bool
	infos []pdproto.RankInfo
	err   error // what the room is told: never the registry's own words
	at    time.Time
}

// retryFailedAfter is how soon a failed registry lookup may be tried again.
const retryFailedAfter = time.Second

// lookupFailure is what a room is told of a failed lookup: the registry's
// own words (its error text, its ranks' fields) go to the log only.
func lookupFailure(url string, timeout time.Duration, err error) error {
	var inc *pdproto.IncompatibleError
	switch {
	case errors.As(err, &inc) && inc.Field == "kv_dtype" && knownKVType(inc.Prefill) && knownKVType(inc.Decode):
		// Both values are names this build knows, not the registry's
		// free text, so they may be told.
		return fmt.Errorf("the prefill at %s does not fit this decode (kv_dtype differs: the prefill stores KV as %s, this decode as %s; both must run one --kv-dtype)",
			url, inc.Prefill, inc.Decode)
	case errors.As(err, &inc):
		return fmt.Errorf("the prefill at %s does not fit this decode (%s differs; see the decode's log)", url, inc.Field)
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("the prefill's registry %s did not answer within %v", url, timeout)
	}
	return fmt.Errorf("the prefill's registry %s could not be looked up (see the decode's log)", url)
}

// knownKVType reports whether s is a quoted KV type name ("f32", "bf16",
// "f16"), as an IncompatibleError holds a compared string.
func knownKVType(s string) bool {
	name, err := strconv.Unquote(s)
	_, ok := kernels.KVTypes[name]
	return err == nil && ok
}
