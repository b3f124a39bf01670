package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/config"
	"github.com/pdkit/pdkit/internal/gpu"
	"github.com/pdkit/pdkit/internal/metrics"
	"github.com/pdkit/pdkit/internal/procstat"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/kernels"
)

type serveOptions struct {
	canaries    time.Duration // --canary-interval (colocated)
	engine      engineFlags
	host        string
	advertise   string // --advertise-host
	port        int
	modelName   string
	cfg         serve.Config
	stallAfter  time.Duration
	collTimeout time.Duration
	maxQueue    time.Duration
	shutdown    time.Duration
	http        httpFlags

	noPrefixCache bool
	kvMemory      config.Budget
	hicache       hicacheFlags
	adminToken    string
	bootstrapPort int // prefill: the registry's port
	secret        secretFlags
}

func newServeCmd() *cobra.Command {
	return newEngineCmd(pdproto.RoleColocated, "serve [--model FILE] [--host H] [--port P] [--tp N]",
		"Serve the OpenAI-compatible HTTP API with a colocated engine (prefill and decode in one process)")
}

func newPrefillCmd() *cobra.Command {
	return newEngineCmd(pdproto.RolePrefill, "prefill [--model FILE] [--port P] [--bootstrap-port B] [--tp N]",
		"Run a PD prefill server: computes prompts' KV and streams it to decode servers over ZeroMQ; serves its bootstrap registry on --bootstrap-port")
}

func newDecodeCmd() *cobra.Command {
	return newEngineCmd(pdproto.RoleDecode, "decode [--model FILE] [--port P] [--tp N]",
		"Run a PD decode server: receives prompts' KV from prefill servers and generates the tokens")
}

// newEngineCmd is the command of one engine role: the same engine, flags
// and HTTP API, the role's part of a request differing.
func newEngineCmd(role, use, short string) *cobra.Command {
	o := serveOptions{}
	o.cfg.Role = role
	// The engine's defaults, written once in package serve.
	def := serve.DefaultConfig()
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return serveRun(cmd, o)
		},
	}
	f := cmd.Flags()
	f.StringSliceVar(&o.cfg.Faults, "fault", nil, "fault switch to turn on at start (repeatable; see GET /debug/v1/faults)")
	if role != pdproto.RoleColocated {
		f.StringVar(&o.cfg.PD.Host, "pd-host", def.PD.Host, "address the ranks' ZeroMQ sockets bind (and advertise, without --advertise-host)")
		f.DurationVar(&o.cfg.PD.BootstrapTimeout, "bootstrap-timeout", def.PD.BootstrapTimeout, "longest a PD request may wait without a word from its peer (a prefill: TRANSFER_INFO or QUEUED from the decode; a decode: the prefill's registry); a room queued for memory waits on, within --request-timeout")
		f.DurationVar(&o.cfg.PD.SendTimeout, "send-timeout", def.PD.SendTimeout, "longest handing one PD message to the transport may take")
		f.Int64Var(&o.cfg.PD.MaxMessageBytes, "max-message-bytes", 0, "largest frame a rank's PD socket accepts; a peer that sends a larger one is dropped and counted (0: derived from the model, the largest KV chunk frame on a decode or TRANSFER_INFO on a prefill, plus 64 KiB)")
		f.IntVar(&o.cfg.PD.MaxPeerSockets, "max-peer-sockets", def.PD.MaxPeerSockets, "peer sockets a rank keeps open, the least recently used closed first (counted)")
		f.DurationVar(&o.cfg.PD.PeerSocketIdle, "peer-socket-idle", def.PD.PeerSocketIdle, "a peer socket unused this long is closed (counted); the next message reconnects")
		f.DurationVar(&o.cfg.PD.HandshakeTimeout, "pd-handshake-timeout", def.PD.HandshakeTimeout, "a connection to a PD socket that has not authenticated within this is closed (counted with the refused ones), so silent connections cannot pile up")
		f.IntVar(&o.cfg.PD.MaxConnections, "pd-max-connections", def.PD.MaxConnections, "connections a rank's PD socket holds at once; those not yet authenticated hold at most a quarter of the places (a sixteenth from one source), the oldest shed first, and a newcomer is refused (a refused peer reconnects) only when members hold every place")
		f.IntVar(&o.cfg.PD.ReplyQueue, "reply-queue", def.PD.ReplyQueue, "replies (ABORT_ACK, heartbeats) a rank holds for sending; one that finds the queue or its peer's backlog full is dropped and counted")
		o.secret.register(f)
	}
	switch role {
	case pdproto.RolePrefill:
		f.IntVar(&o.bootstrapPort, "bootstrap-port", 8998, "port of the bootstrap registry (0: pick a free one)")
		f.DurationVar(&o.cfg.PD.InflightTimeout, "inflight-timeout", def.PD.InflightTimeout, "longest a prefill waits for the decode to acknowledge the KV")
		f.IntVar(&o.cfg.PD.EarlyRoomsPerSender, "early-rooms-per-sender", def.PD.EarlyRoomsPerSender, "rooms one sender (the endpoint its messages name) may hold in a rank's mailbox before their requests arrive, of the 4096 all share; more are dropped and counted")
	case pdproto.RoleDecode:
		f.DurationVar(&o.cfg.PD.TransferTimeout, "transfer-timeout", def.PD.TransferTimeout, "longest a decode waits for a prompt's KV")
		f.DurationVar(&o.cfg.PD.AbortAckTimeout, "abort-ack-timeout", def.PD.AbortAckTimeout, "longest an aborted room's pages stay reserved waiting for the prefill's ABORT_ACK")
		f.DurationVar(&o.cfg.PD.HeartbeatInterval, "heartbeat-interval", def.PD.HeartbeatInterval, "how often each rank probes the prefill ranks it waits on")
		f.DurationVar(&o.cfg.PD.HeartbeatTimeout, "heartbeat-timeout", def.PD.HeartbeatTimeout, "how long a prefill rank may leave probes unanswered before its rooms fail")
		f.IntVar(&o.cfg.PD.ReservedDecodeTokens, "reserved-decode-tokens", def.PD.ReservedDecodeTokens, "output tokens of room kept per request held before pages go to a new transfer (negative: none)")
		f.StringSliceVar(&o.cfg.PD.PrefillBootstrap, "prefill-bootstrap", nil, "bootstrap registry URL of a prefill server this decode takes requests for (repeatable or comma-separated); a request's bootstrap_url must be one of them, else it is refused before anything is fetched")
		f.IntVar(&o.cfg.PD.BootstrapCacheSize, "bootstrap-cache-size", def.PD.BootstrapCacheSize, "prefill registry lookups kept, the least recently used dropped first")
	}
	o.engine.register(f)
	f.StringVar(&o.host, "host", "127.0.0.1", "address to listen on")
	f.StringVar(&o.advertise, "advertise-host", "", advertiseUsage)
	f.IntVar(&o.port, "port", 8000, "port to listen on (0: pick a free one)")
	f.StringVar(&o.modelName, "model-name", "", "model name served by the API (default: the model's general.name, else the file name)")
	f.IntVar(&o.cfg.TP, "tp", def.TP, "tensor-parallel ranks; must divide the model's head counts")
	f.IntVar(&o.cfg.MaxRunning, "max-running", def.MaxRunning, "requests admitted at once")
	f.IntVar(&o.cfg.PageSize, "page-size", def.PageSize, "KV page size in tokens")
	f.IntVar(&o.cfg.KVTokens, "kv-tokens", 0, "KV capacity per rank in tokens (0: from --kv-memory, else max-running × context length)")
	f.Var(&o.kvMemory, "kv-memory", "memory for the KV pools of every rank together, as bytes (e.g. 2GiB) or a share of the memory this process may use (0.25 or 25%: of the machine's, or its cgroup's limit when smaller); each rank holds as many pages as its share fits, at the bytes a token takes in --kv-dtype; instead of --kv-tokens")
	f.IntVar(&o.cfg.MaxBatchTokens, "max-batch-tokens", def.MaxBatchTokens, "tokens per step, prefill and decode together")
	f.IntVar(&o.cfg.PrefillChunk, "prefill-chunk", def.PrefillChunk, "prompt tokens per request per step")
	f.BoolVar(&o.noPrefixCache, "no-prefix-cache", false, "turn the radix prefix cache off (every prompt computed from its first token)")
	f.StringVar(&o.cfg.Schedule, "schedule", serve.ScheduleAuto, "rank loop: lockstep (each step's forward pass in line), overlap (the loop lands the last step and plans the next one beside the forward pass) or auto (overlap when the ranks' kernel threads, --tp × --threads, leave a CPU free, else lockstep)")
	o.hicache.register(f)
	f.DurationVar(&o.cfg.WaitingTimeout, "waiting-timeout", 0, "longest a request may wait for admission (0: no limit)")
	f.DurationVar(&o.cfg.PrefillTimeout, "prefill-timeout", 0, "longest a prompt may take to prefill (0: no limit)")
	f.DurationVar(&o.cfg.RequestTimeout, "request-timeout", def.RequestTimeout, "longest a request may take in all, queued or not (negative: no limit)")
	f.DurationVar(&o.collTimeout, "collective-timeout", time.Minute, "when a collective of the rank group has waited this long, or the group broke, fail the requests in flight, rebuild the group with a new boot number and serve on (0: stop the engine instead); must exceed --stall-after")
	f.DurationVar(&o.stallAfter, "stall-after", 5*time.Second, "/health answers 503 when the engine loop has not iterated for this long, and the collective watchdog reports a collective that waits this long (0: 5s)")
	f.DurationVar(&o.maxQueue, "max-queue-age", 0, "/health reports the server busy (still 200: queued is not dead) while a request has waited longer than this for admission, and routers send it no new requests (0: never)")
	f.DurationVar(&o.shutdown, "shutdown-timeout", 10*time.Second, "how long a shutdown lets requests in flight, streams included, finish; those still running then end with an error")
	f.DurationVar(&o.canaries, "canary-interval", time.Minute, "a colocated server's time between two of its own correctness probes: a prompt run cached (from the host tier where it is on) and without the cache, greedy, whose outputs must agree (GET /debug/v1/settings canaries; 0: none; a prefill or decode server's router runs them)")
	f.StringVar(&o.adminToken, "admin-token", "", "bearer token the /admin/v1/ API requires (empty: with a cluster secret, the token it derives, which pdctl sends given the secret; without one, admin calls only when listening on loopback)")
	o.http.register(f)
	return cmd
}

func serveRun(cmd *cobra.Command, o serveOptions) error {
	stderr := cmd.ErrOrStderr()
	// Each setting is checked once, by what it configures, and refused
	// before anything is built: the listeners' here, the HTTP server's by
	// its Options, the engine's by serve.New (Config.Validate, the PD
	// machine's rules among them). Their errors name the flags already,
	// so they pass on as usage errors unchanged.
	if err := errors.Join(checkPort("--port", o.port), checkPort("--bootstrap-port", o.bootstrapPort), checkShutdown(o.shutdown)); err != nil {
		return usageError{err}
	}
	opts := server.Options{ModelName: o.modelName, StallAfter: o.stallAfter, MaxQueueAge: o.maxQueue, AdminToken: o.adminToken,
		// /livez waits out a collective's recovery before it fails.
		Probes: server.Probes{LiveAfter: max(server.DefaultLiveAfter, 2*o.collTimeout), ReadyFailureRate: o.http.readyFailureRate, ReadyWindow: o.http.readyWindow}}
	if err := opts.Validate(); err != nil {
		return usageError{err}
	}
	threads := o.engine.threads
	if threads == 0 {
		threads = max(1, runtime.NumCPU()/max(1, o.cfg.TP))
	}
	backend, err := rankBackends(o.engine.backend, threads)
	if err != nil {
		return err
	}
	schedule, why, err := resolveSchedule(o.cfg.Schedule, o.engine.backend, threads, o.cfg.TP)
	if err != nil {
		return err
	}
	guard, err := o.http.guard()
	if err != nil {
		return err
	}
	ik, err := kernels.ParseIndexKDType(o.engine.indexK)
	if err != nil {
		return usageError{err}
	}
	kv, err := o.engine.kvType()
	if err != nil {
		return err
	}
	cfg := o.cfg
	if cfg.KVMemory, err = kvMemoryBytes(o.kvMemory, cfg.KVTokens, stderr); err != nil {
		return err
	}
	cfg.Schedule = schedule
	cfg.IndexK = ik
	cfg.KVType = kv
	cfg.DisablePrefixCache = o.noPrefixCache
	if cfg.HiCache, err = o.hicache.config(o.noPrefixCache); err != nil {
		return err
	}
	cfg.Backend = backend
	httpHost, err := o.advertisedHosts(&cfg.PD)
	if err != nil {
		return err
	}
	path, err := resolveModel(o.engine.model, stderr)
	if err != nil {
		return err
	}
	m, err := openModel(path)
	if err != nil {
		return err
	}
	defer m.Close()
	// One registry per server: the engine reports tokens and timings to it
	// as it runs, and /metrics also reads the engine's snapshot when scraped.
	met := metrics.New(nil)
	cfg.Observer = met
	log := slog.New(slog.NewTextHandler(stderr, nil))
	logClamped(log, guard)
	if why != "" {
		log.Info("rank loop", "schedule", schedule, "why", why)
	}
	if cfg.Role != pdproto.RoleColocated {
		if cfg.PD.Secret, err = o.secret.load(log, o.host, cfg.PD.Host, cfg.PD.AdvertiseHost); err != nil {
			return err
		}
		o.cfg.PD.Secret = cfg.PD.Secret // the registry's
	}
	cfg.CollectiveWatchdog = o.stallAfter
	cfg.CollectiveTimeout = o.collTimeout
	cfg.OnStall = func(s dist.Stall) { log.Warn("collective stalled", "seq", s.Seq, "stall", s.String()) }
	// serve.New refuses only impossible settings (it validates them
	// after its defaults, --collective-timeout against --stall-after
	// among them), so its error is a usage error.
	// A prefill re-registers its ranks after a live index-K switch; the
	// registry exists once the engine does.
	var reg atomic.Pointer[bootstrap.Registry]
	cfg.PD.OnRankInfos = func(infos []pdproto.RankInfo) {
		if r := reg.Load(); r != nil {
			if err := r.Replace(infos); err != nil {
				log.Error("bootstrap registry: re-registering the ranks", "err", err)
			}
		}
	}
	eng, err := serve.New(m, cfg)
	if errors.Is(err, hicache.ErrHostMemory) {
		return usagef("%v: lower --hicache-size or --hicache-ratio", err)
	}
	if err != nil {
		return usageError{err}
	}
	defer eng.Close()
	if cfg.Role == pdproto.RoleDecode && len(cfg.PD.PrefillBootstrap) == 0 {
		log.Warn("no --prefill-bootstrap: every PD request is refused until a prefill registry is allowed")
	}
	if ts := eng.View().HiCache(); len(ts) > 0 && ts[0].On {
		log.Info("hicache on", "host_tokens_per_rank", ts[0].HostPages*ts[0].PageSize, "policy", ts[0].Policy,
			"load_bandwidth", config.FormatRate(ts[0].LoadBandwidth))
	}

	ln, err := listen(o.host, o.port, "--port")
	if err != nil {
		return err
	}
	loopback := isLoopback(ln.Addr())
	if !loopback && o.adminToken == "" && cfg.PD.Secret == nil {
		log.Warn("admin API disabled: listening beyond loopback without --admin-token", "addr", ln.Addr().String())
	}
	var bootstrapURL string
	if cfg.Role == pdproto.RolePrefill {
		stop, url, err := serveRegistry(eng, o, httpHost, log, &reg, met.Registry())
		if err != nil {
			return err
		}
		defer stop()
		bootstrapURL = url
		fmt.Fprintf(stderr, "bootstrap registry on %s\n", url)
	}
	// GPU telemetry: the devices NVML sees, or why there are none (this
	// build computes on the CPU either way).
	tel := gpu.Open()
	defer tel.Close()
	if r := tel.Read(); r.Available {
		log.Info("gpu telemetry", "devices", len(r.Devices), "driver", r.Driver)
	} else {
		log.Info("gpu telemetry", "state", r.Reason)
	}
	opts.ModelPath, opts.Logger, opts.Metrics, opts.GPU = path, log, met, tel
	opts.Loopback, opts.ClusterSecret, opts.BootstrapURL = loopback, cfg.PD.Secret, bootstrapURL
	h := server.New(eng, m, opts)
	met.Registry().MustRegister(guard)
	// In-flight handlers are waited for before the model is closed: a
	// handler cut off by the shutdown timeout may still be detokenizing.
	var inflight sync.WaitGroup
	counted := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inflight.Add(1)
		defer inflight.Done()
		h.ServeHTTP(w, r)
	})
	srv := guard.Server(counted, slog.NewLogLogger(log.Handler(), slog.LevelWarn))
	served := clientURL(ln, o.host, o.advertise)
	if httpHost != "" {
		served = httpURL(httpHost, listenPort(ln))
	}
	fmt.Fprintf(stderr, "serving %s (%s) on %s\n", h.ModelName(), cfg.Role, served)

	// A colocated server probes itself; the router probes PD pairs.
	canaryCtx, stopCanaries := context.WithCancel(context.Background())
	var canaryDone sync.WaitGroup
	if cfg.Role == pdproto.RoleColocated && o.canaries > 0 {
		canaryDone.Go(func() { h.RunCanaries(canaryCtx, o.canaries) })
	}
	defer canaryDone.Wait()
	defer stopCanaries()

	// At the shutdown deadline the engine closes first: it ends every
	// stream still running with an error event, so its client knows.
	serr := serveUntilDone(cmd.Context(), srv, guard.Listener(ln), log, o.shutdown, func() { eng.Close() })
	cerr := eng.Close() // finishes the streams of any handler still running
	inflight.Wait()
	if serr != nil {
		return serr
	}
	return cerr
}

// serveRegistry registers a prefill engine's ranks in a bootstrap registry
// and serves it on --bootstrap-port; url is where decodes reach it, at host.
// stop shuts it down.
func serveRegistry(eng *serve.Engine, o serveOptions, host string, log *slog.Logger, published *atomic.Pointer[bootstrap.Registry], met prometheus.Registerer) (stop func(), url string, err error) {
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: eng.View().Ranks(), Secret: o.cfg.PD.Secret})
	for _, info := range eng.PD().RankInfos() {
		if _, berr := reg.Register(info); berr != nil {
			return nil, "", berr
		}
	}
	published.Store(reg)
	if err := watchRegistry(met, reg); err != nil {
		return nil, "", err
	}
	ln, err := listen(o.host, o.bootstrapPort, "--bootstrap-port")
	if err != nil {
		return nil, "", fmt.Errorf("bootstrap registry: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	srv := o.http.g.Server(mux, slog.NewLogLogger(log.Handler(), slog.LevelWarn))
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv.Serve(o.http.g.Listener(ln))
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if srv.Shutdown(ctx) != nil {
			srv.Close()
		}
		<-done
	}, httpURL(host, listenPort(ln)), nil
}

// advertisedHosts resolves what a PD server advertises: its ranks' ZeroMQ
// endpoints (into pd.AdvertiseHost) and its HTTP URLs (httpHost: the
// bootstrap URL, logs). A PD server hands both to peers, so a wildcard
// bind without --advertise-host is refused. A colocated server hands
// nothing to peers: httpHost is "" (a wildcard --advertise-host is still
// refused).
func (o serveOptions) advertisedHosts(pd *serve.PDConfig) (httpHost string, err error) {
	if o.cfg.Role == pdproto.RoleColocated {
		return "", checkAdvertise(o.advertise)
	}
	if pd.AdvertiseHost, err = advertiseHost(pd.Host, o.advertise, "--pd-host"); err != nil {
		return "", err
	}
	return advertiseHost(o.host, o.advertise, "--host")
}

// isLoopback reports whether a listener's address is a loopback one (an
// unspecified address such as 0.0.0.0 is not).
func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// kvMemoryBytes turns --kv-memory into bytes: a share is taken of the
// memory this process may use, which is said on stderr. --kv-tokens and
// --kv-memory together are refused: each alone sizes the pool.
func kvMemoryBytes(b config.Budget, kvTokens int, stderr io.Writer) (int64, error) {
	if b.IsZero() {
		return 0, nil
	}
	if kvTokens != 0 {
		return 0, usagef("--kv-tokens and --kv-memory both size the KV pool: give one")
	}
	if b.Fraction == 0 {
		return b.Bytes, nil
	}
	mem, err := procstat.MemoryOf()
	if err != nil {
		return 0, fmt.Errorf("--kv-memory %v: %w", &b, err)
	}
	n := b.Of(mem.Limit())
	from := "the machine's"
	if mem.Limit() < mem.Machine {
		from = "the cgroup's limit (" + mem.CgroupFile + ")"
	}
	gib := func(n int64) string { return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30)) }
	fmt.Fprintf(stderr, "kv-memory: %v of %s %s: %s for the KV pools\n", &b, from, gib(mem.Limit()), gib(n))
	return n, nil
}
