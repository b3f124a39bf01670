package chattemplate

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// # Bounded rendering
//
// A chat template is a program that the model's file brings, and the
// Jinja engine has no bound of its own on time, memory, output or
// recursion: {{ 'x' * 100000000000 }} asks for 100 GB, a macro that
// calls itself overflows the stack (a crash no recover catches), and a
// loop that runs only when a message holds a trigger word turns one
// request into gigabytes. A goroutine cannot be stopped from outside,
// and the engine is not pdkit's to instrument, so a Sandbox renders in
// worker processes, the running binary started again in a worker mode
// (worker.go), each under its bounds:
//
//   - time: the server gives a render Bounds.Time and kills the worker
//     past it (the worker also exits by itself soon after, should the
//     server be gone);
//   - memory: the worker's address space may grow by Bounds.Memory past
//     what it holds once started (RLIMIT_AS, Linux), so an allocation
//     past it fails and the worker dies;
//   - recursion: its goroutines' stacks are bounded by Bounds.Stack
//     (runtime/debug.SetMaxStack), so deep recursion ends the worker,
//     not the server;
//   - output: a render of more than Options.MaxOutput bytes (the most
//     text a prompt that fits the context can have) is refused.
//
// A worker that passed a bound is killed, which releases all it held;
// the render is a *BoundError naming the bound, and the next render
// starts a new worker. Workers render one conversation at a time, at
// most Workers at once, so a template that runs long holds one worker
// and slows no render on the others. Nothing is compiled in the server
// process either: Compile too runs in a worker, since a deeply nested
// expression overflows the parser's stack.

// Bounds are what one render may use.
type Bounds struct {
	// Time is the wall time of one render (default 2s).
	Time time.Duration
	// Memory is the address space a worker may map past what it held
	// once started (default 512 MiB).
	Memory int64
	// Stack is the most stack a render may use (default 16 MiB, some
	// tens of thousands of nested macro calls).
	Stack int
	// Output is the most bytes a render may write when Options.MaxOutput
	// does not say (default 8 MiB).
	Output int
	// Workers is how many worker processes render at once (default
	// GOMAXPROCS, at least 2 and at most 8).
	Workers int
}

func (b Bounds) withDefaults() Bounds {
	if b.Time <= 0 {
		b.Time = 2 * time.Second
	}
	if b.Memory <= 0 {
		b.Memory = 512 << 20
	}
	if b.Stack <= 0 {
		b.Stack = 16 << 20
	}
	if b.Output <= 0 {
		b.Output = 8 << 20
	}
	if b.Workers <= 0 {
		b.Workers = min(max(runtime.GOMAXPROCS(0), 2), 8)
	}
	return b
}

// BoundError is a render that passed one of its bounds: the template, on
// that conversation, asked for more than a chat template may.
type BoundError struct {
	Bound string // "time", "memory", "recursion" or "output"
	Limit string // the bound, as a person reads it
}

func (e *BoundError) Error() string {
	return "rendering the chat template passed its " + e.Bound + " bound of " + e.Limit
}

// The bounds a BoundError names.
const (
	BoundTime      = "time"
	BoundMemory    = "memory"
	BoundRecursion = "recursion"
	BoundOutput    = "output"
)

// SandboxStats counts what a Sandbox did.
type SandboxStats struct {
	Renders  uint64 // renders answered, refusals included
	Bounded  uint64 // renders that passed a bound (their worker killed)
	Started  uint64 // worker processes started
	Workers  int    // worker processes alive now
	InFlight int    // renders running now
}

// Sandbox renders chat templates in worker processes under Bounds. It is
// safe for concurrent use.
type Sandbox struct {
	bounds Bounds
	slots  chan struct{} // one per render running

	mu     sync.Mutex
	idle   []*worker
	live   int
	closed bool

	renders, bounded, started atomic.Uint64
	inFlight                  atomic.Int64
}

// NewSandbox makes a Sandbox; workers start on the first render.
func NewSandbox(b Bounds) *Sandbox {
	b = b.withDefaults()
	return &Sandbox{bounds: b, slots: make(chan struct{}, b.Workers)}
}

var shared = sync.OnceValue(func() *Sandbox { return NewSandbox(Bounds{}) })

// Shared is the process's Sandbox of default Bounds. Its idle workers
// live as long as the process (each exits once its parent is gone).
func Shared() *Sandbox { return shared() }

// Bounds returns the sandbox's bounds, defaults filled in.
func (s *Sandbox) Bounds() Bounds { return s.bounds }

// Stats returns a snapshot of the counters.
func (s *Sandbox) Stats() SandboxStats {
	s.mu.Lock()
	live := s.live
	s.mu.Unlock()
	return SandboxStats{Renders: s.renders.Load(), Bounded: s.bounded.Load(), Started: s.started.Load(),
		Workers: live, InFlight: int(s.inFlight.Load())}
}

// Close stops the idle workers; a render running finishes, and its
// worker is stopped after it.
func (s *Sandbox) Close() {
	s.mu.Lock()
	idle := s.idle
	s.idle, s.closed = nil, true
	s.mu.Unlock()
	for _, w := range idle {
		s.stop(w)
	}
}

// Sandboxed is a template rendered by a Sandbox: only its source is kept
// here, compiled in each worker that renders it.
type Sandboxed struct {
	s    *Sandbox
	src  string
	opts Options
}

// Compile checks that src compiles, in a worker, and returns the template
// the sandbox renders.
func (s *Sandbox) Compile(ctx context.Context, src string, o Options) (*Sandboxed, error) {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.MaxOutput <= 0 {
		o.MaxOutput = s.bounds.Output
	}
	t := &Sandboxed{s: s, src: src, opts: o}
	if _, err := s.do(ctx, t, nil, false, true); err != nil {
		return nil, err
	}
	return t, nil
}

// Render renders msgs as Template.Render does, under the sandbox's
// bounds; a render past one is a *BoundError, a template's refusal a
// *RaiseError. ctx ends the wait for a worker and the render itself.
func (t *Sandboxed) Render(ctx context.Context, msgs []Message, addGenerationPrompt bool) (string, error) {
	return t.s.do(ctx, t, msgs, addGenerationPrompt, false)
}

// Check is Template.Check under the sandbox's bounds.
func (t *Sandboxed) Check(ctx context.Context) error {
	return check(func(msgs []Message) (string, error) { return t.Render(ctx, msgs, true) })
}

func (s *Sandbox) do(ctx context.Context, t *Sandboxed, msgs []Message, gen, compileOnly bool) (string, error) {
	select {
	case s.slots <- struct{}{}:
	case <-ctx.Done():
		return "", context.Cause(ctx)
	}
	defer func() { <-s.slots }()
	s.inFlight.Add(1)
	defer s.inFlight.Add(-1)
	w, err := s.take()
	if err != nil {
		return "", err
	}
	req := workRequest{Source: t.src, BOS: t.opts.BOS, EOS: t.opts.EOS, Now: t.opts.Now().UnixNano(),
		Generation: gen, MaxOutput: t.opts.MaxOutput, CompileOnly: compileOnly}
	for _, m := range msgs {
		req.Messages = append(req.Messages, workMessage(m))
	}
	resp, err := w.render(ctx, &req, s.bounds.Time)
	if err != nil {
		s.stop(w)
		return "", s.failure(ctx, w, err)
	}
	s.renders.Add(1)
	if resp.Bound != "" { // the worker refused its own output: stop it, so that its memory goes
		s.stop(w)
		s.bounded.Add(1)
		return "", &BoundError{Bound: resp.Bound, Limit: fmt.Sprintf("%d bytes", t.opts.MaxOutput)}
	}
	s.put(w)
	switch {
	case resp.Raise != nil:
		return "", &RaiseError{Message: *resp.Raise}
	case resp.Err != "":
		return "", errors.New(resp.Err)
	}
	return resp.Out, nil
}

// failure says why a render's worker failed it, once the worker is
// stopped and its last words read.
func (s *Sandbox) failure(ctx context.Context, w *worker, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	said := w.stderr.String()
	var bound *BoundError
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		bound = &BoundError{Bound: BoundTime, Limit: s.bounds.Time.String()}
	case strings.Contains(said, "stack overflow") || strings.Contains(said, "stack exceeds"):
		bound = &BoundError{Bound: BoundRecursion, Limit: "a " + mib(int64(s.bounds.Stack)) + " stack"}
	case strings.Contains(said, "out of memory") || strings.Contains(said, "address space") ||
		strings.Contains(said, "cannot allocate") || w.exitCode() == raceExitCode:
		bound = &BoundError{Bound: BoundMemory, Limit: mib(s.bounds.Memory)}
	}
	if bound != nil {
		s.renders.Add(1)
		s.bounded.Add(1)
		return bound
	}
	last := strings.TrimSpace(said)
	if i := strings.IndexByte(last, '\n'); i >= 0 {
		last = last[:i]
	}
	return fmt.Errorf("chat template renderer: %w (%s)", err, last)
}

// raceExitCode is how the race detector's runtime ends a process that
// cannot map more memory for its shadow.
const raceExitCode = 66

func mib(n int64) string { return fmt.Sprintf("%d MiB", n>>20) }

// take returns an idle worker, or starts one.
func (s *Sandbox) take() (*worker, error) {
	s.mu.Lock()
	if n := len(s.idle); n > 0 {
		w := s.idle[n-1]
		s.idle = s.idle[:n-1]
		s.mu.Unlock()
		return w, nil
	}
	s.live++
	s.mu.Unlock()
	w, err := startWorker(s.bounds)
	if err != nil {
		s.mu.Lock()
		s.live--
		s.mu.Unlock()
		return nil, err
	}
	s.started.Add(1)
	return w, nil
}

// put keeps w for the next render, unless the sandbox is closed.
func (s *Sandbox) put(w *worker) {
	s.mu.Lock()
	if !s.closed {
		s.idle = append(s.idle, w)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.stop(w)
}

// stop kills w and waits for it.
func (s *Sandbox) stop(w *worker) {
	w.kill()
	s.mu.Lock()
	s.live--
	s.mu.Unlock()
}

// worker is one worker process and its pipes.
type worker struct {
	cmd    *exec.Cmd
	in     *os.File
	out    *os.File
	stderr *firstWords
	last   string // the source the worker compiled last, which it keeps
}

// workerExe is the binary a worker runs: the running one (/proc/self/exe
// stays valid where the file was replaced since).
func workerExe() (string, error) {
	if runtime.GOOS == "linux" {
		return "/proc/self/exe", nil
	}
	return os.Executable()
}

func startWorker(b Bounds) (*worker, error) {
	exe, err := workerExe()
	if err != nil {
		return nil, fmt.Errorf("chat template renderer: %w", err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), workerEnv+"="+b.encode(), "GOMAXPROCS=1", "GOTRACEBACK=single")
	cmd.Args = []string{"pdkit-chat-template-worker"}
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("chat template renderer: %w", err)
	}
	stdoutR, stdoutW, err := os.Pipe()
	if err != nil {
		stdinR.Close()
		stdinW.Close()
		return nil, fmt.Errorf("chat template renderer: %w", err)
	}
	w := &worker{cmd: cmd, in: stdinW, out: stdoutR, stderr: &firstWords{}}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdinR, stdoutW, w.stderr
	err = cmd.Start()
	stdinR.Close()
	stdoutW.Close()
	if err != nil {
		stdinW.Close()
		stdoutR.Close()
		return nil, fmt.Errorf("chat template renderer: starting a worker: %w", err)
	}
	return w, nil
}

// render sends req and reads the answer, within bound and ctx.
func (w *worker) render(ctx context.Context, req *workRequest, bound time.Duration) (*workResponse, error) {
	src := req.Source
	if w.last == src {
		req.Source, req.Known = "", true
	}
	deadline := time.Now().Add(bound)
	w.in.SetWriteDeadline(deadline)
	w.out.SetReadDeadline(deadline)
	stop := context.AfterFunc(ctx, func() {
		w.in.SetWriteDeadline(time.Unix(1, 0))
		w.out.SetReadDeadline(time.Unix(1, 0))
	})
	defer stop()
	if err := writeFrame(w.in, req); err != nil {
		return nil, err
	}
	var resp workResponse
	if err := readFrame(w.out, &resp, maxResponseBytes(req.MaxOutput)); err != nil {
		return nil, err
	}
	if w.last = ""; resp.Compiled {
		w.last = src
	}
	return &resp, nil
}

// kill ends the worker and waits for it (and its stderr) to be done.
func (w *worker) kill() {
	w.in.Close()
	w.cmd.Process.Kill()
	w.cmd.Wait()
	w.out.Close()
}

func (w *worker) exitCode() int {
	if w.cmd.ProcessState == nil {
		return -1
	}
	return w.cmd.ProcessState.ExitCode()
}

// firstWords keeps the first KiB a worker writes to stderr (a fatal error
// says what it is first).
type firstWords struct {
	mu  sync.Mutex
	buf []byte
}

func (l *firstWords) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if room := 1024 - len(l.buf); room > 0 {
		l.buf = append(l.buf, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (l *firstWords) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.buf)
}
