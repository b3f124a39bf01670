package server

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/engine/chattemplate"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/sample"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/engine/tokenizer"
	"github.com/pdkit/pdkit/internal/canary"
	"github.com/pdkit/pdkit/internal/gpu"
	"github.com/pdkit/pdkit/internal/httpx"
	"github.com/pdkit/pdkit/internal/metrics"
)

// Options configure a Server. Zero values take the defaults noted per field.
type Options struct {
	// ModelName is the name the API serves the model under (default: the
	// model's general.name, else the base name of ModelPath without its
	// extension, else "pdkit").
	ModelName string
	// ModelPath is the model's file, for the default name.
	ModelPath string
	// StallAfter is how long the engine loop may go without iterating
	// before /health answers 503 (default 5s; not negative).
	StallAfter time.Duration
	// MaxQueueAge makes /health report the server busy (status "busy",
	// still 200: queued is not dead) while a request has waited for
	// admission longer than this, so that routers send it no new work
	// (0: queue age never does; not negative).
	MaxQueueAge time.Duration
	// MaxBodyBytes bounds request bodies (default 4 MiB).
	MaxBodyBytes int64
	// Logger receives the server's logs (default slog.Default()).
	Logger *slog.Logger
	// ChatSandbox renders the model's chat template in its worker
	// processes, under its bounds (nil: chattemplate.Shared()).
	ChatSandbox *chattemplate.Sandbox
	// Metrics backs GET /metrics. The server attaches the engine to it
	// (Metrics.Watch). Set the same Metrics as the engine's
	// serve.Config.Observer to get the token counters and the latency
	// histograms; default: a fresh registry with the engine's gauges and
	// counters only.
	Metrics *metrics.Metrics
	// AdminToken, when set, is the bearer token every /admin/v1/ call
	// must carry (Authorization: Bearer <token>).
	AdminToken string
	// Loopback says the server listens on a loopback address only. Without
	// an AdminToken or a ClusterSecret, admin calls are allowed only then.
	Loopback bool
	// ClusterSecret is the PD cluster's shared secret (nil without one).
	// With it set, admin calls need a bearer token (AdminToken, or the
	// one the secret derives), loopback or not.
	ClusterSecret *clusterauth.Secret
	// BootstrapURL is a prefill server's bootstrap registry, which
	// GET /pd/v1/info reports to routers.
	BootstrapURL string
	// Probes configure GET /livez and /readyz (probes.go).
	Probes Probes
	// GPU backs GET /debug/v1/gpu and the pdkit_gpu_* metrics (default:
	// off, "no GPU" with the reason). The caller closes it.
	GPU *gpu.Telemetry
	// IndexKMargin is how long past its drain bound an index-K switch call
	// (POST /admin/v1/indexk/...) waits for the switch before it answers
	// 202, the switch still under way (default and most:
	// debug.IndexKSwitchMargin, which is what clients wait for).
	IndexKMargin time.Duration
}

// Validate refuses options no server can run by, as New will read them
// (a zero takes its default). It is the one check of these settings:
// pdserve's engine commands call it before they build anything and pass its
// error on as a usage error, unchanged, so each error names the setting's
// flag ("stall after -1s (--stall-after)").
func (o Options) Validate() error {
	var errs []error
	if o.StallAfter < 0 {
		errs = append(errs, fmt.Errorf("server: stall after %v (--stall-after) must not be negative (0: 5s)", o.StallAfter))
	}
	if o.MaxQueueAge < 0 {
		errs = append(errs, fmt.Errorf("server: max queue age %v (--max-queue-age) must not be negative (0: never)", o.MaxQueueAge))
	}
	return errors.Join(errs...)
}

// Server is the HTTP handler. It is safe for concurrent use.
type Server struct {
	canaries canary.Tally // RunCanaries' outcomes (canary.go)
	// id names this run of the server (pdproto.ServerInfo.ID): the PD
	// requests it takes are signed for it, and verifier takes each once.
	id       string
	verifier *clusterauth.Verifier
	// tags is each stream's client request id (X-Request-Id), by engine
	// id, while it runs: the debug entries name it.
	tags    sync.Map
	eng     *serve.Engine
	m       *model.Model
	tok     tokenizer.Tokenizer
	tmpl    ChatTemplate // picked at New from the model's chat template
	opts    Options
	limits  openai.Limits
	log     *slog.Logger
	mux     *httpx.Mux
	created int64
	recent  *httpx.RecentFailures // the readiness window (probes.go)
	// bound refuses prompts that cannot fit before they are tokenized,
	// and tokenize holds the places of requests tokenizing now
	// (promptcap.go).
	bound    openai.PromptBound
	tokenize chan struct{}
	// instance tags this server's response ids (idOf): random at start.
	instance string

	// The index-K switch the admin API started and the engine has not
	// finished: its precision, empty when none (under indexKMu).
	indexKMu sync.Mutex
	indexKTo string
}

// New returns a server over eng, which must serve m.
func New(eng *serve.Engine, m *model.Model, opts Options) *Server {
	if opts.ModelName == "" {
		opts.ModelName = m.Name
	}
	if opts.ModelName == "" && opts.ModelPath != "" {
		base := filepath.Base(opts.ModelPath)
		opts.ModelName = strings.TrimSuffix(base, filepath.Ext(base))
	}
	if opts.ModelName == "" {
		opts.ModelName = "pdkit"
	}
	if opts.StallAfter <= 0 {
		opts.StallAfter = 5 * time.Second
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = openai.DefaultMaxBodyBytes
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Metrics == nil {
		opts.Metrics = metrics.New(nil)
	}
	if opts.IndexKMargin <= 0 || opts.IndexKMargin > debug.IndexKSwitchMargin {
		opts.IndexKMargin = debug.IndexKSwitchMargin
	}
	if opts.GPU == nil {
		opts.GPU = gpu.Off("no GPU: telemetry is not enabled on this server")
	}
	if err := opts.Metrics.WatchGPU(opts.GPU); err != nil {
		opts.Logger.Debug("metrics: GPU collector not registered", "err", err)
	}
	if err := opts.Metrics.Watch(eng); err != nil {
		// Already watched (a second server on the same Metrics): the
		// registered collector serves.
		opts.Logger.Debug("metrics: engine collector not registered", "err", err)
	}
	bound := openai.PromptBound{ContextTokens: m.Config.ContextLen, TokenBytes: tokenBytes(m.Tokenizer)}
	s := &Server{
		eng: eng, m: m, tok: m.Tokenizer, opts: opts, log: opts.Logger,
		tmpl: PickChatTemplate(m.ChatTemplate(), m.Tokenizer, opts.ChatSandbox, bound.ContextTokens*bound.TokenBytes, opts.Logger),
		limits: openai.Limits{
			MaxBodyBytes: bound.BodyBytes(opts.MaxBodyBytes),
			MaxTokens:    m.Config.ContextLen,
			Models:       []string{opts.ModelName},
		},
		mux:      httpx.NewMux(opts.Logger),
		created:  time.Now().Unix(),
		bound:    bound,
		tokenize: make(chan struct{}, tokenizePlaces()),
		instance: fmt.Sprintf("%08x", rand.Uint32()),
		id:       "srv-" + crand.Text(),
	}
	s.verifier = &clusterauth.Verifier{Secret: opts.ClusterSecret, Self: s.id}
	s.handle("POST", "/v1/completions", arrival(s.keepBody(s.completions)))
	s.handle("POST", "/v1/chat/completions", arrival(s.keepBody(s.chat)))
	s.handle("GET", "/v1/models", s.models)
	s.handle("POST", "/generate", arrival(s.keepBody(s.generateNative)))
	s.handle("POST", "/abort_request", s.abort)
	s.handle("GET", "/health", s.health)
	s.registerProbes()
	s.handle("GET", "/metrics", opts.Metrics.Handler().ServeHTTP)
	s.handle("GET", debug.StatePath, s.state)
	s.handle("GET", debug.SettingsPath, s.settings)
	s.handle("GET", pdproto.InfoPath, s.pdInfo)
	s.handle("GET", "/debug/v1/faults", s.faults)
	s.handle("GET", "/debug/v1/stacks", s.stacks)
	s.handle("GET", "/debug/v1/steps", s.steps)
	s.handle("GET", "/debug/v1/collectives", s.collectives)
	s.handle("GET", "/debug/v1/requests", s.requests)
	s.handle("GET", "/debug/v1/pd", s.pd)
	s.handle("GET", debug.DecisionsPath, s.decisions)
	s.handle("GET", debug.HiCachePath, s.hicache)
	s.handle("GET", debug.GPUPath, func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, s.opts.GPU.Read()) })
	s.mux.HandlePrefix("/admin/v1/", s.adminHandler())
	opts.Logger.Debug("chat template", "name", s.tmpl.Name(), "from_gguf", m.ChatTemplate() != "")
	return s
}

func (s *Server) handle(method, path string, h http.HandlerFunc) { s.mux.Handle(method, path, h) }

// arrivedKey is the context key of a generation request's arrival time.
type arrivedKey struct{}

// arrival notes when a generation request arrived, for its end-to-end
// latency (observed once the engine has taken it: served).
func arrival(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		h(w, r.WithContext(context.WithValue(r.Context(), arrivedKey{}, time.Now())))
	}
}

// served records the end-to-end latency of a request the engine took.
func (s *Server) served(r *http.Request) {
	if t, ok := r.Context().Value(arrivedKey{}).(time.Time); ok {
		s.opts.Metrics.RequestServed(s.opts.ModelName, time.Since(t))
	}
}

// ModelName is the name the server answers to.
func (s *Server) ModelName() string { return s.opts.ModelName }

// ServeHTTP serves r, turning a handler panic into a logged 500.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

func writeJSON(w http.ResponseWriter, status int, v any) { httpx.WriteJSON(w, status, v) }

// job is one generation as the handlers see it.
type job struct {
	prompt   []int32
	params   openai.Params
	stream   bool
	usage    bool // stream_options.include_usage
	idPrefix string
	chat     bool
	pd       *serve.PDRequest // the PD side of a disaggregated request
	n        int              // choices: samples of the prompt (0 or 1: one)
	probe    bool             // the router's canary: in no metric (serve.Request.Probe)
}

// probeOf says whether a request is the router's canary: marked so, and a
// PD request (which a server with a secret takes only signed, from the
// router).
func probeOf(f openai.PD) bool { return f.Probe && f.BootstrapRoom != nil }

// pdOf is the engine's form of a request's PD fields; nil without a room.
func pdOf(f openai.PD) *serve.PDRequest {
	if f.BootstrapRoom == nil {
		return nil
	}
	return &serve.PDRequest{Room: *f.BootstrapRoom, BootstrapURL: f.BootstrapURL}
}

// submit checks the prompt against the context and submits the job: one
// stream per choice (a prefill server's side of a PD request has one
// whatever n is: the decode samples the choices).
func (s *Server) submit(w http.ResponseWriter, r *http.Request, j *job) ([]*serve.Stream, *openai.Error) {
	tag, oerr := httpx.ClientRequestID(r)
	if oerr != nil {
		return nil, oerr
	}
	if len(j.prompt) == 0 {
		return nil, openai.InvalidRequest("prompt", "the prompt is empty")
	}
	ctxLen := s.m.Config.ContextLen
	if len(j.prompt) > ctxLen-j.params.MaxTokens {
		return nil, openai.InvalidRequest("prompt", fmt.Sprintf(
			"the prompt has %d tokens; with max_tokens %d it exceeds the context length of %d tokens",
			len(j.prompt), j.params.MaxTokens, ctxLen))
	}
	seed := uint64(j.params.Seed)
	if !j.params.HasSeed {
		seed = rand.Uint64()
	}
	st, err := s.eng.SubmitN(r.Context(), serve.Request{
		Prompt:    j.prompt,
		MaxTokens: j.params.MaxTokens,
		Sampling:  sample.Params{Temperature: float32(j.params.Temperature), TopP: float32(j.params.TopP), Seed: seed},
		IgnoreEOS: j.params.IgnoreEOS,
		NoCache:   j.params.NoCache,
		PD:        j.pd,
		N:         j.n,
		Tag:       tag,
		Probe:     j.probe,
	})
	switch {
	case err == nil:
		if tag != "" {
			w.Header().Set(httpx.RequestIDHeader, tag)
			for _, x := range st {
				s.tags.Store(x.ID, tag)
			}
		}
		return st, nil
	case errors.Is(err, serve.ErrClosed):
		return nil, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer, Message: err.Error()}
	case errors.Is(err, serve.ErrRoomInUse):
		return nil, &openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest, Param: "bootstrap_room", Message: err.Error()}
	case errors.Is(err, serve.ErrBootstrapURL):
		return nil, &openai.Error{Status: http.StatusForbidden, Type: openai.TypeInvalidRequest, Param: "bootstrap_url", Message: err.Error()}
	case r.Context().Err() != nil:
		return nil, &openai.Error{Status: 499, Type: openai.TypeInvalidRequest, Message: "client closed the request"}
	}
	return nil, openai.InvalidRequest("", err.Error())
}

// untag forgets the client request id of sts, which have ended.
func (s *Server) untag(sts []*serve.Stream) {
	for _, st := range sts {
		s.tags.Delete(st.ID)
	}
}

// tagOf is the client request id of engine request id ("" without one).
func (s *Server) tagOf(id uint64) string {
	if v, ok := s.tags.Load(id); ok {
		return v.(string)
	}
	return ""
}

// outcome is how a generation ended.
type outcome struct {
	finish string
	usage  openai.Usage
	err    string // an engine failure ("error: ..."), empty otherwise
	reason string // the engine's finish reason
}

// cutError is the error event that ends a stream the engine cut (an
// engine failure or shutdown, a timeout) before its [DONE], so that the
// client knows it was cut; nil for a stream that ended by itself or by an
// abort someone asked for, which its finish_reason "abort" says.
func cutError(out outcome) *openai.Error {
	switch {
	case out.reason == serve.ReasonClosed:
		return openai.ServerError("the server shut down before the request finished")
	case out.err != "":
		return openai.ServerError(out.err)
	case out.reason == serve.ReasonTimeout:
		return openai.ServerError("the request timed out in the server")
	}
	// An abort (the client's, the router's, an operator's, a drain's)
	// ends with its finish_reason and [DONE]: it is no failure.
	return nil
}

// run reads st to its end, passing emit each piece of final text (see the
// package doc on stop strings). emit's error (a client gone) aborts st.
func (s *Server) run(st *serve.Stream, stops []string, emit func(string) error) (outcome, error) {
	dec := tokenizer.NewStreamDecoder(s.tok)
	var pending string
	n := 0
	for ev := range st.Events {
		if f := ev.Finish; f != nil {
			pending += dec.Flush()
			out := outcome{usage: usage(f.PromptTokens, f.CompletionTokens), reason: f.Reason}
			if i := firstStop(pending, stops); i >= 0 {
				pending, out.finish = pending[:i], openai.FinishStop
			} else {
				switch f.Reason {
				case serve.ReasonStop, serve.ReasonLength, serve.ReasonAbort:
					out.finish = f.Reason
				case serve.ReasonTimeout:
					out.finish = openai.FinishAbort
				default:
					out.finish, out.err = openai.FinishAbort, f.Reason
				}
			}
			if pending != "" {
				if err := emit(pending); err != nil {
					return out, err
				}
			}
			return out, nil
		}
		n++
		if !s.tok.IsEOG(ev.Token) {
			pending += dec.Add(ev.Token)
		}
		if i := firstStop(pending, stops); i >= 0 {
			st.AbortSample()
			prompt := 0
			for ev := range st.Events {
				if ev.Finish != nil {
					prompt = ev.Finish.PromptTokens
				}
			}
			out := outcome{finish: openai.FinishStop, usage: usage(prompt, n)}
			if i > 0 {
				if err := emit(pending[:i]); err != nil {
					return out, err
				}
			}
			return out, nil
		}
		cut := len(pending) - holdback(pending, stops)
		if cut > 0 {
			if err := emit(pending[:cut]); err != nil {
				st.Abort()
				return outcome{}, err
			}
			pending = pending[cut:]
		}
	}
	return outcome{finish: openai.FinishAbort, err: "error: stream closed without a finish"}, nil
}

func usage(prompt, completion int) openai.Usage {
	return openai.Usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion}
}

// firstStop is the index of the earliest stop string in text, or -1.
func firstStop(text string, stops []string) int {
	best := -1
	for _, s := range stops {
		if s == "" {
			continue
		}
		if i := strings.Index(text, s); i >= 0 && (best < 0 || i < best) {
			best = i
		}
	}
	return best
}

// holdback is the length of the longest suffix of text that is a proper
// prefix of a stop string: text that a later token may turn into a stop.
func holdback(text string, stops []string) int {
	hold := 0
	for _, s := range stops {
		for k := min(len(s)-1, len(text)); k > hold; k-- {
			if strings.HasSuffix(text, s[:k]) {
				hold = k
				break
			}
		}
	}
	return hold
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	req, oerr := openai.DecodeCompletion(r.Body, s.limits)
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	if req.PD.BootstrapRoom != nil && !s.verifyPD(w, r) {
		return
	}
	j := &job{params: req.Params(s.limits), stream: req.Stream, idPrefix: "cmpl-", pd: pdOf(req.PD), n: req.Choices(), probe: probeOf(req.PD)}
	j.usage = req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	if req.Prompt.Tokens != nil {
		if oerr := s.bound.Tokens(len(req.Prompt.Tokens), j.params.MaxTokens); oerr != nil {
			oerr.WriteJSON(w)
			return
		}
		vocab := s.tok.VocabSize()
		j.prompt = make([]int32, len(req.Prompt.Tokens))
		for i, t := range req.Prompt.Tokens {
			if t < 0 || t >= vocab {
				openai.InvalidRequest("prompt", fmt.Sprintf("token %d at %d is outside the vocabulary of %d", t, i, vocab)).WriteJSON(w)
				return
			}
			j.prompt[i] = int32(t)
		}
	} else {
		if oerr := s.bound.Text("prompt", len(req.Prompt.Text), j.params.MaxTokens); oerr != nil {
			oerr.WriteJSON(w)
			return
		}
		var p []int32
		var err error
		if werr := s.tokenizing(r.Context(), func() error { p, err = s.tok.Encode(req.Prompt.Text, true); return nil }); werr != nil {
			clientGone(w, werr)
			return
		}
		if err != nil {
			openai.InvalidRequest("prompt", err.Error()).WriteJSON(w)
			return
		}
		j.prompt = p
	}
	s.serveJob(w, r, j)
}

// ChatPrompt renders messages with the default template (see the package
// doc) and encodes them; EncodeChat takes the template.
func ChatPrompt(t tokenizer.Tokenizer, msgs []openai.Message) ([]int32, error) {
	return EncodeChat(t, DefaultChatTemplate(), msgs)
}

func (s *Server) chat(w http.ResponseWriter, r *http.Request) {
	req, oerr := openai.DecodeChat(r.Body, s.limits)
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	if req.PD.BootstrapRoom != nil && !s.verifyPD(w, r) {
		return
	}
	j := &job{params: req.Params(s.limits), stream: req.Stream, idPrefix: "chatcmpl-", chat: true, pd: pdOf(req.PD), n: req.Choices(), probe: probeOf(req.PD)}
	j.usage = req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	if oerr := s.bound.Messages(req.Messages, j.params.MaxTokens); oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	var p []int32
	var err error
	if werr := s.tokenizing(r.Context(), func() error { p, err = encodeChat(r.Context(), s.tok, s.tmpl, req.Messages); return nil }); werr != nil {
		clientGone(w, werr)
		return
	}
	if err != nil {
		chatError(s.log, err).WriteJSON(w)
		return
	}
	j.prompt = p
	s.serveJob(w, r, j)
}

// choice is one choice's result.
type choice struct {
	text strings.Builder
	out  outcome
}

// total sums the choices' usage: the prompt once, every choice's
// completion tokens.
func total(cs []*choice) openai.Usage {
	prompt, completion := 0, 0
	for _, c := range cs {
		prompt = max(prompt, c.out.usage.PromptTokens)
		completion += c.out.usage.CompletionTokens
	}
	return usage(prompt, completion)
}

func (s *Server) serveJob(w http.ResponseWriter, r *http.Request, j *job) {
	sts, oerr := s.submit(w, r, j)
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	defer s.untag(sts)
	st := sts[0]
	if !j.probe {
		defer s.served(r)
	}
	defer st.Abort()
	id := s.idOf(j.idPrefix, st.ID)
	created := time.Now().Unix()
	if !j.stream {
		cs := s.collectText(sts, j.params.Stop)
		for _, c := range cs {
			if c.out.err != "" {
				openai.ServerError(c.out.err).WriteJSON(w)
				return
			}
		}
		if r.Context().Err() != nil {
			return
		}
		u := total(cs)
		if j.chat {
			resp := openai.ChatCompletionResponse{
				ID: id, Object: openai.ObjectChatCompletion, Created: created, Model: s.opts.ModelName, Usage: u}
			for i, c := range cs {
				resp.Choices = append(resp.Choices, openai.ChatChoice{Index: i,
					Message: openai.ChatMessage{Role: openai.RoleAssistant, Content: c.text.String()}, FinishReason: c.out.finish})
			}
			writeJSON(w, http.StatusOK, resp)
			return
		}
		resp := openai.CompletionResponse{
			ID: id, Object: openai.ObjectTextCompletion, Created: created, Model: s.opts.ModelName, Usage: u}
		for i, c := range cs {
			resp.Choices = append(resp.Choices, openai.CompletionChoice{Index: i, Text: c.text.String(), FinishReason: c.out.finish})
		}
		writeJSON(w, http.StatusOK, resp)
		return
	}

	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	rc.Flush()
	chunk := func(i int, text string, finish *string, u *openai.Usage, first bool) any {
		if j.chat {
			c := openai.ChatCompletionChunk{ID: id, Object: openai.ObjectChatChunk, Created: created, Model: s.opts.ModelName, Usage: u,
				Choices: []openai.ChatChunkChoice{}}
			if u == nil {
				d := openai.ChatDelta{Content: text}
				if first {
					d.Role = openai.RoleAssistant
				}
				c.Choices = append(c.Choices, openai.ChatChunkChoice{Index: i, Delta: d, FinishReason: finish})
			}
			return c
		}
		c := openai.CompletionChunk{ID: id, Object: openai.ObjectTextCompletion, Created: created, Model: s.opts.ModelName, Usage: u,
			Choices: []openai.CompletionChunkChoice{}}
		if u == nil {
			c.Choices = append(c.Choices, openai.CompletionChunkChoice{Index: i, Text: text, FinishReason: finish})
		}
		return c
	}
	// Each choice's events in order: its role (chat), its text, the error
	// event of a choice the engine cut (once per response), its finish;
	// the choices' events interleave as their tokens come.
	var mu sync.Mutex
	gone, cutSent := false, false
	write := func(v any) error {
		if gone {
			return errClientGone
		}
		if err := openai.WriteEvent(w, v); err != nil {
			gone = true
			return err
		}
		return nil
	}
	first := make([]bool, len(sts))
	for i := range first {
		first[i] = true
		if j.chat {
			if write(chunk(i, "", nil, nil, true)) != nil {
				return
			}
			first[i] = false
		}
	}
	var wg sync.WaitGroup
	outs := make([]*choice, len(sts))
	for i, st := range sts {
		wg.Go(func() {
			out, err := s.run(st, j.params.Stop, func(t string) error {
				mu.Lock()
				defer mu.Unlock()
				err := write(chunk(i, t, nil, nil, first[i]))
				first[i] = false
				return err
			})
			outs[i] = &choice{out: out}
			mu.Lock()
			defer mu.Unlock()
			if err != nil || r.Context().Err() != nil {
				gone = true
				return
			}
			if e := cutError(out); e != nil && !cutSent {
				cutSent = true
				write(e.Body())
			}
			finish := out.finish
			write(chunk(i, "", &finish, nil, first[i]))
		})
	}
	wg.Wait()
	if gone || r.Context().Err() != nil {
		return
	}
	if j.usage {
		u := total(outs)
		if write(chunk(0, "", nil, &u, false)) != nil {
			return
		}
	}
	openai.WriteDone(w)
}

// errClientGone stops the writers of a stream whose client went.
var errClientGone = errors.New("server: the client went")

// collectText runs every stream of a request to its end, collecting each
// choice's text.
func (s *Server) collectText(sts []*serve.Stream, stops []string) []*choice {
	cs := make([]*choice, len(sts))
	var wg sync.WaitGroup
	for i, st := range sts {
		cs[i] = &choice{}
		wg.Go(func() {
			c := cs[i]
			c.out, _ = s.run(st, stops, func(t string) error { c.text.WriteString(t); return nil })
		})
	}
	wg.Wait()
	return cs
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, openai.ModelList{Object: openai.ObjectList, Data: []openai.Model{{
		ID: s.opts.ModelName, Object: openai.ObjectModel, Created: s.created, OwnedBy: "pdkit",
	}}})
}

// GenerateRequest is the body of the native POST /generate. A PD router
// adds bootstrap_room (an unsigned 64-bit integer, as a JSON number or a
// string of digits) and, for the decode side, bootstrap_url, as it does to
// OpenAI requests.
type GenerateRequest struct {
	Text           string          `json:"text"`
	SamplingParams SamplingParams  `json:"sampling_params"`
	BootstrapRoom  json.RawMessage `json:"bootstrap_room,omitempty"`
	BootstrapURL   string          `json:"bootstrap_url,omitempty"`
}

// hasPD reports whether the request carries a bootstrap_room (well
// formed or not): such a request must be signed (verifyPD).
func (g *GenerateRequest) hasPD() bool {
	raw := bytes.TrimSpace(g.BootstrapRoom)
	return len(raw) > 0 && string(raw) != "null"
}

// pd is the engine's form of the request's PD fields; nil without a room.
func (g *GenerateRequest) pd() (*serve.PDRequest, *openai.Error) {
	raw := bytes.TrimSpace(g.BootstrapRoom)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if raw[0] == '"' {
		var str string
		if json.Unmarshal(raw, &str) != nil {
			return nil, openai.InvalidRequest("bootstrap_room", `"bootstrap_room" must be an unsigned 64-bit integer`)
		}
		raw = []byte(str)
	}
	room, err := strconv.ParseUint(string(raw), 10, 64)
	if err != nil {
		return nil, openai.InvalidRequest("bootstrap_room", `"bootstrap_room" must be an unsigned 64-bit integer`)
	}
	return &serve.PDRequest{Room: room, BootstrapURL: g.BootstrapURL}, nil
}

// SamplingParams are /generate's sampling settings; absent ones take
// max_new_tokens 16, temperature 1, top_p 1, n 1 and a random seed.
type SamplingParams struct {
	MaxNewTokens *int     `json:"max_new_tokens"`
	Temperature  *float64 `json:"temperature"`
	TopP         *float64 `json:"top_p"`
	Seed         *int64   `json:"seed"`
	Stop         []string `json:"stop"`
	IgnoreEOS    bool     `json:"ignore_eos"`
	// NoCache computes the whole prompt, reading no cached KV (as the
	// OpenAI APIs' no_cache).
	NoCache bool `json:"no_cache"`
	// N is the number of samples (1 to openai.MaxChoices); more than one
	// answers an array of results, one per sample.
	N *int `json:"n"`
}

// GenerateResponse is the answer of POST /generate.
type GenerateResponse struct {
	Text     string   `json:"text"`
	MetaInfo MetaInfo `json:"meta_info"`
}

// MetaInfo describes a /generate result.
type MetaInfo struct {
	ID               string `json:"id"`
	PromptTokens     int    `json:"prompt_tokens"`
	CompletionTokens int    `json:"completion_tokens"`
	FinishReason     string `json:"finish_reason"`
}

func (s *Server) generateNative(w http.ResponseWriter, r *http.Request) {
	var req GenerateRequest
	if oerr := decodeJSON(w, r, s.limits.MaxBodyBytes, &req); oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	if req.hasPD() && !s.verifyPD(w, r) {
		return
	}
	// The native request is checked and defaulted as a completion request,
	// so both APIs share one set of limits; only the parameter names differ.
	sp := req.SamplingParams
	cr := openai.CompletionRequest{
		Prompt: openai.Prompt{Text: req.Text}, MaxTokens: sp.MaxNewTokens, Temperature: sp.Temperature,
		TopP: sp.TopP, Seed: sp.Seed, Stop: sp.Stop, IgnoreEOS: sp.IgnoreEOS, NoCache: sp.NoCache,
	}
	if oerr := cr.Validate(s.limits); oerr != nil {
		oerr.Param = nativeParam[oerr.Param]
		oerr.WriteJSON(w)
		return
	}
	p := cr.Params(s.limits)
	if oerr := s.bound.Text("text", len(req.Text), p.MaxTokens); oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	var prompt []int32
	var err error
	if werr := s.tokenizing(r.Context(), func() error { prompt, err = s.tok.Encode(req.Text, true); return nil }); werr != nil {
		clientGone(w, werr)
		return
	}
	if err != nil {
		openai.InvalidRequest("text", err.Error()).WriteJSON(w)
		return
	}
	pd, oerr := req.pd()
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	n := 1
	if sp.N != nil {
		n = *sp.N
	}
	if n < 1 || n > openai.MaxChoices {
		openai.InvalidRequest("sampling_params.n", fmt.Sprintf(`"sampling_params.n" must be between 1 and %d, got %d`, openai.MaxChoices, n)).WriteJSON(w)
		return
	}
	sts, oerr := s.submit(w, r, &job{prompt: prompt, params: p, pd: pd, n: n})
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	defer s.untag(sts)
	defer s.served(r)
	defer sts[0].Abort()
	cs := s.collectText(sts, p.Stop)
	resps := make([]GenerateResponse, len(cs))
	for i, c := range cs {
		if c.out.err != "" {
			openai.ServerError(c.out.err).WriteJSON(w)
			return
		}
		resps[i] = GenerateResponse{Text: c.text.String(), MetaInfo: MetaInfo{
			ID: strconv.FormatUint(sts[i].ID, 10), PromptTokens: c.out.usage.PromptTokens,
			CompletionTokens: c.out.usage.CompletionTokens, FinishReason: c.out.finish,
		}}
	}
	if n == 1 {
		writeJSON(w, http.StatusOK, resps[0])
		return
	}
	// n > 1: an array of one result per sample, as the reference server.
	writeJSON(w, http.StatusOK, resps)
}

// nativeParam names /generate's fields for the completion-request fields
// its values are checked as.
var nativeParam = map[string]string{
	"prompt": "text", "max_tokens": "sampling_params.max_new_tokens", "temperature": "sampling_params.temperature",
	"top_p": "sampling_params.top_p", "stop": "sampling_params.stop",
}

// decodeJSON reads a JSON body into v, strictly typed, with a size bound.
func decodeJSON(w http.ResponseWriter, r *http.Request, max int64, v any) *openai.Error {
	body := http.MaxBytesReader(w, r.Body, max)
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		var te *json.UnmarshalTypeError
		switch {
		case errors.As(err, &mbe):
			return &openai.Error{Status: http.StatusRequestEntityTooLarge, Type: openai.TypeInvalidRequest,
				Code: openai.CodeRequestTooLarge, Message: fmt.Sprintf("the body exceeds %d bytes", max)}
		case errors.As(err, &te):
			return openai.InvalidRequest(te.Field, fmt.Sprintf("%s must be %s, not %s", te.Field, te.Type, te.Value))
		}
		return openai.InvalidRequest("", "malformed JSON body: "+err.Error())
	}
	if dec.More() {
		return openai.InvalidRequest("", "malformed JSON body: data after the object")
	}
	return nil
}

// AbortRequest is the body of POST /abort_request.
type AbortRequest struct {
	RID string `json:"rid"`
}

// abort serves POST /abort_request under the admin rule (adminRule): the
// engine's ids are sequential, so anyone else could cancel any stream. A
// client reaches its own streams' abort through the router, whose ids are
// unguessable.
func (s *Server) abort(w http.ResponseWriter, r *http.Request) {
	if oerr := s.adminRule().Check(w, r); oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	var req AbortRequest
	if oerr := decodeJSON(w, r, s.limits.MaxBodyBytes, &req); oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	id, ok := parseID(req.RID)
	if !ok {
		openai.InvalidRequest("rid", fmt.Sprintf("rid %q is not a request id (cmpl-N, chatcmpl-N or N)", req.RID)).WriteJSON(w)
		return
	}
	if !s.ownID(req.RID) {
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Param: "rid",
			Message: fmt.Sprintf("rid %q is another server's request", req.RID)}).WriteJSON(w)
		return
	}
	s.eng.Abort(id)
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "rid": req.RID})
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func (s *Server) stacks(w http.ResponseWriter, r *http.Request) {
	var buf bytes.Buffer
	if err := pprof.Lookup("goroutine").WriteTo(&buf, 1); err != nil {
		openai.ServerError(err.Error()).WriteJSON(w)
		return
	}
	out := buf.Bytes()
	if rank := r.URL.Query().Get("rank"); rank != "" {
		if _, err := strconv.Atoi(rank); err != nil {
			openai.InvalidRequest("rank", fmt.Sprintf("rank %q is not a number", rank)).WriteJSON(w)
			return
		}
		out = filterRank(out, rank)
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Write(out)
}

// filterRank keeps the header and the goroutine groups of a debug=1
// goroutine profile whose labels carry rank.
func filterRank(profile []byte, rank string) []byte {
	header, rest, _ := bytes.Cut(profile, []byte("\n"))
	want := []byte(`"rank":"` + rank + `"`)
	out := append(header, '\n')
	for b := range bytes.SplitSeq(rest, []byte("\n\n")) {
		if bytes.Contains(b, want) {
			out = append(out, '\n')
			out = append(out, bytes.TrimRight(b, "\n")...)
			out = append(out, '\n')
		}
	}
	return out
}

// pdInfo describes the server to a PD router.
func (s *Server) pdInfo(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, pdproto.ServerInfo{ID: s.id, Role: s.eng.Config().Role, Model: s.opts.ModelName,
		TPSize: s.eng.View().Ranks(), BootstrapURL: s.opts.BootstrapURL,
		ContextTokens: s.bound.ContextTokens, TokenBytes: s.bound.TokenBytes})
}
