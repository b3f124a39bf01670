package main

import (
	"fmt"
	"log/slog"
	"net/url"
	"time"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/internal/httpx"
	"github.com/pdkit/pdkit/internal/router"
)

type routerOptions struct {
	host           string
	advertise      string // --advertise-host
	port           int
	prefill        []string
	decode         []string
	healthInterval time.Duration
	maxQueued      int
	shutdown       time.Duration
	adminToken     string
	canaries       time.Duration
	http           httpFlags
	secret         secretFlags
}

func newRouterCmd() *cobra.Command {
	o := routerOptions{}
	cmd := &cobra.Command{
		Use:   "router --prefill URL[,URL...] --decode URL[,URL...] [--host H] [--port P] [--cluster-secret-file F]",
		Short: "Serve the OpenAI-compatible HTTP API in front of prefill and decode servers (a PD cluster)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return routerRun(cmd, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.host, "host", "127.0.0.1", "address to listen on")
	f.StringVar(&o.advertise, "advertise-host", "", advertiseUsage)
	f.IntVar(&o.port, "port", 8000, "port to listen on (0: pick a free one)")
	f.StringSliceVar(&o.prefill, "prefill", nil, "prefill servers' base URLs (comma-separated, repeatable)")
	f.StringSliceVar(&o.decode, "decode", nil, "decode servers' base URLs (comma-separated, repeatable)")
	f.DurationVar(&o.healthInterval, "health-interval", time.Second, "time between two health checks of a server; two failed checks in a row mark it down")
	f.IntVar(&o.maxQueued, "max-queued", router.DefaultMaxQueued, "admission bound: a server whose queue depth (its queued requests at the last health check plus the router's sent since) reaches this gets no new request; when no server of a role has room, requests are answered 429 with Retry-After (0: no bound)")
	f.DurationVar(&o.shutdown, "shutdown-timeout", 10*time.Second, "how long a shutdown lets requests in flight, streams included, finish; those still running then end with an error event")
	f.StringVar(&o.adminToken, "admin-token", "", "bearer token the router's admin calls (POST /admin/v1/pause and /admin/v1/resume) require (empty: with a cluster secret, the token it derives, which pdctl sends given the secret; without one, admin calls only when listening on loopback)")
	f.DurationVar(&o.canaries, "canary-interval", router.DefaultCanaryInterval, "time between two of the router's correctness probes: a prompt sent cached (from the prefill's host tier where it is on) and without the cache through a prefill and decode pair, greedy, whose outputs must agree (pdkit_router_canaries_total; 0: none)")
	o.http.register(f)
	o.secret.register(f)
	f.Lookup("cluster-secret").Usage = "the PD cluster's shared secret, the servers' (at least 16 bytes; prefer PD_CLUSTER_SECRET or --cluster-secret-file): " +
		"the router signs every request it sends to a prefill or decode server with it, and servers holding it refuse unsigned PD requests; " +
		"required unless every server URL's host is loopback"
	return cmd
}

// canaryInterval is --canary-interval as router.Options takes it: 0 is none.
func canaryInterval(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

func routerRun(cmd *cobra.Command, o routerOptions) error {
	stderr := cmd.ErrOrStderr()
	if err := checkPort("--port", o.port); err != nil {
		return err
	}
	if len(o.prefill) == 0 || len(o.decode) == 0 {
		return usagef("router needs at least one --prefill and one --decode server URL")
	}
	var hosts []string // the servers', for the cluster secret's rule
	for _, u := range append(append([]string{}, o.prefill...), o.decode...) {
		parsed, err := router.ParseServerURL(u)
		if err != nil {
			return usageError{err}
		}
		if pu, err := url.Parse(parsed); err == nil {
			hosts = append(hosts, pu.Hostname())
		}
	}
	if err := checkAdvertise(o.advertise); err != nil {
		return err
	}
	if o.healthInterval <= 0 {
		return usagef("--health-interval %v must be positive", o.healthInterval)
	}
	if err := checkShutdown(o.shutdown); err != nil {
		return err
	}
	if o.maxQueued < 0 {
		return usagef("--max-queued %d: want 0 (no bound) or more", o.maxQueued)
	}
	guard, err := o.http.guard()
	if err != nil {
		return err
	}
	maxQueued := o.maxQueued
	if maxQueued == 0 {
		maxQueued = -1 // router.Options: negative is no bound
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	logClamped(log, guard)
	// The servers' rule: without a secret, only a router whose servers are
	// all on loopback runs (its requests go unsigned).
	secret, err := o.secret.load(log, hosts...)
	if err != nil {
		return err
	}
	ln, err := listen(o.host, o.port, "--port")
	if err != nil {
		return err
	}
	admin := httpx.AdminRule{Token: o.adminToken}
	if admin.Token == "" {
		admin = httpx.AdminRule{Token: secret.AdminToken(), Derived: secret != nil, Loopback: isLoopback(ln.Addr())}
	}
	rt, err := router.New(router.Options{Prefill: o.prefill, Decode: o.decode, HealthInterval: o.healthInterval, MaxQueued: maxQueued, Logger: log,
		ReadyFailureRate: o.http.readyFailureRate, ReadyWindow: o.http.readyWindow, Guard: guard, ClusterSecret: secret, Admin: admin, CanaryInterval: canaryInterval(o.canaries)})
	if err != nil {
		ln.Close()
		return usageError{err} // only a bad server list is refused
	}
	defer rt.Close()
	srv := guard.Server(rt, slog.NewLogLogger(log.Handler(), slog.LevelWarn))
	fmt.Fprintf(stderr, "routing on %s (prefill %v, decode %v)\n", clientURL(ln, o.host, o.advertise), o.prefill, o.decode)

	// At the shutdown deadline every request still in flight is cut: a
	// stream ends with an error event, so its client knows.
	return serveUntilDone(cmd.Context(), srv, guard.Listener(ln), log, o.shutdown, func() { rt.Cut() })
}
