// Package launch supervises a small cluster of child processes on one
// machine: it starts them, waits until every one answers its health URL,
// forwards its output line by line under the child's name, and stops them
// all together, when its context ends or when any one of them dies. It
// knows nothing of what the children are: `pdserve launch` gives it the
// router, prefill and decode servers as plain command lines.
//
// Nothing is left behind. Each child runs in its own process group, so a
// stop reaches the processes it started too (SIGTERM to the group, SIGKILL
// after a grace period), and every child is waited for before Start (on
// failure) or Run returns. On Linux each child also gets SIGKILL when the
// launcher dies (Pdeathsig), so even a launcher killed with SIGKILL leaves
// no server running; that covers the child itself, not processes it started
// in turn. The package is for Unix systems.
package launch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Spec describes one child process.
type Spec struct {
	Name      string   // unique in the cluster; prefixes its output lines
	Role      string   // what it is (router, prefill, decode); shown in reports
	Path      string   // the executable
	Args      []string // its arguments, without the program name
	Env       []string // its whole environment, as in exec.Cmd (nil: the launcher's)
	HealthURL string   // ready once a GET answers 200; empty: ready once started
	// FixedPorts says the child's ports were chosen by the user rather
	// than reserved with FreePorts: when one of them is taken
	// (ErrAddrInUse), Launch does not retry, since fresh ports would not
	// change it.
	FixedPorts bool
}

// Options tune a cluster; the zero value gives the defaults.
type Options struct {
	// Output receives every child's output lines, each prefixed with the
	// child's name, and the launcher's own reports (default os.Stderr).
	Output io.Writer
	// ReadyTimeout bounds the wait for every health URL (default 2m).
	ReadyTimeout time.Duration
	// Grace is how long a stop waits after SIGTERM before SIGKILL (default 10s).
	Grace time.Duration
	// PollInterval is the pause between health checks (default 50ms).
	PollInterval time.Duration
	// TailLines is how many last output lines of a child an error quotes
	// (default 20).
	TailLines int
}

func (o Options) withDefaults() Options {
	if o.Output == nil {
		o.Output = os.Stderr
	}
	if o.ReadyTimeout <= 0 {
		o.ReadyTimeout = 2 * time.Minute
	}
	if o.Grace <= 0 {
		o.Grace = 10 * time.Second
	}
	if o.PollInterval <= 0 {
		o.PollInterval = 50 * time.Millisecond
	}
	if o.TailLines <= 0 {
		o.TailLines = 20
	}
	return o
}

// ErrAddrInUse matches (with errors.Is) a start-up failure in which a child
// exited before it was ready saying "address already in use".
var ErrAddrInUse = errors.New("address already in use")

// ChildError reports a child that exited on its own: its name, pid, how it
// ended and the last lines it wrote.
type ChildError struct {
	Name, Role  string
	Pid         int
	Status      string   // "exit status 1", "signal: killed", or why it could not be waited for
	BeforeReady bool     // it exited while the cluster was starting
	Output      []string // its last output lines, oldest first
}

func (e *ChildError) Error() string {
	when := "exited"
	if e.BeforeReady {
		when = "exited before it was ready"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s (%s, pid %d) %s: %s", e.Name, e.Role, e.Pid, when, e.Status)
	writeTail(&b, e.Output)
	return b.String()
}

// Is makes errors.Is(err, ErrAddrInUse) true for a child that failed to
// start because its port was taken.
func (e *ChildError) Is(target error) bool {
	if target != ErrAddrInUse || !e.BeforeReady {
		return false
	}
	for _, l := range e.Output {
		if strings.Contains(l, "address already in use") {
			return true
		}
	}
	return false
}

func writeTail(b *strings.Builder, lines []string) {
	if len(lines) == 0 {
		return
	}
	b.WriteString("; last output:")
	for _, l := range lines {
		b.WriteString("\n    ")
		b.WriteString(l)
	}
}

// Child is a running child: its spec and process id.
type Child struct {
	Spec
	Pid int
}

// Cluster is a set of started children. Run it once; it stops them all.
type Cluster struct {
	opts     Options
	out      *prefixWriter
	children []*child
	exits    chan *child // each child sends itself once, when reaped
	client   *http.Client
	spawner  *spawner

	stopOnce sync.Once
	stopErr  error
}

// child is one process and the goroutines that own it: a waiter (reaps it,
// closes exited) and one reader per output pipe.
type child struct {
	spec   Spec
	pid    int
	cmd    *exec.Cmd
	exited chan struct{} // closed once reaped; state and waitErr are then set
	state  *os.ProcessState
	// waitErr is Wait's error other than a plain non-zero exit.
	waitErr  error
	pipes    []*os.File // read ends, owned by the readers until stop closes them
	readers  sync.WaitGroup
	tail     *tail
	reported bool // its exit has been reported (only the Run goroutine touches it)
}

func (ch *child) status() string {
	if ch.state != nil {
		return ch.state.String()
	}
	if ch.waitErr != nil {
		return ch.waitErr.Error()
	}
	return "unknown status"
}

func (ch *child) error(beforeReady bool) *ChildError {
	return &ChildError{Name: ch.spec.Name, Role: ch.spec.Role, Pid: ch.pid, Status: ch.status(),
		BeforeReady: beforeReady, Output: ch.tail.lines()}
}

// Launch builds the specs and starts them (Start). When a child fails to
// start because its port was taken (ErrAddrInUse), it builds the specs
// again and retries once: ports reserved with FreePorts are free when
// reserved but may be taken by another process before the child binds them.
// A child with FixedPorts is not retried: its ports would be the same.
func Launch(ctx context.Context, build func() ([]Spec, error), opts Options) (*Cluster, error) {
	specs, err := build()
	if err != nil {
		return nil, err
	}
	c, err := Start(ctx, specs, opts)
	if !errors.Is(err, ErrAddrInUse) || fixedPorts(specs, err) {
		return c, err
	}
	out := opts.withDefaults().Output
	fmt.Fprintf(out, "launch: %v\nlaunch: a port was taken; retrying once with fresh ports\n", err)
	if specs, err = build(); err != nil {
		return nil, err
	}
	return Start(ctx, specs, opts)
}

// fixedPorts reports whether err is the failure of a child whose ports
// were fixed by the user.
func fixedPorts(specs []Spec, err error) bool {
	ce, ok := errors.AsType[*ChildError](err)
	if !ok {
		return false
	}
	for _, s := range specs {
		if s.Name == ce.Name {
			return s.FixedPorts
		}
	}
	return false
}

// Start starts every child in order and waits until each answers its
// health URL with 200. On any failure (a child that cannot be started,
// exits before it is ready, or is not ready in time, or ctx ending) it
// stops the children already started, waits for them and returns an error
// naming the child at fault with its last output lines.
func Start(ctx context.Context, specs []Spec, opts Options) (*Cluster, error) {
	opts = opts.withDefaults()
	seen := map[string]bool{}
	for _, s := range specs {
		if s.Name == "" || s.Path == "" {
			return nil, fmt.Errorf("launch: a child needs a name and a path (%+v)", s)
		}
		if seen[s.Name] {
			return nil, fmt.Errorf("launch: two children named %q", s.Name)
		}
		seen[s.Name] = true
	}
	width := len("launch") // the launcher's own lines
	for _, s := range specs {
		width = max(width, len(s.Name))
	}
	c := &Cluster{
		opts:  opts,
		out:   &prefixWriter{w: opts.Output, width: width},
		exits: make(chan *child, len(specs)),
		// No keep-alive: a health check leaves no connection behind.
		client:  &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}},
		spawner: newSpawner(),
	}
	for _, s := range specs {
		if err := c.start(s); err != nil {
			c.stop()
			return nil, fmt.Errorf("launch: start %s: %w", s.Name, err)
		}
	}
	if err := c.waitReady(ctx); err != nil {
		c.stop()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) start(s Spec) error {
	ch := &child{spec: s, exited: make(chan struct{}), tail: newTail(c.opts.TailLines)}
	cmd := exec.Command(s.Path, s.Args...)
	cmd.Env = s.Env
	cmd.SysProcAttr = sysProcAttr()
	// Our own pipes, not cmd.StdoutPipe: Wait then does not wait for the
	// output, and the readers end when every holder of the write end (the
	// child and anything it started) is gone, or when stop closes them.
	var writers []*os.File
	closeAll := func() {
		for _, f := range writers {
			f.Close()
		}
		for _, f := range ch.pipes {
			f.Close()
		}
	}
	for range 2 {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll()
			return err
		}
		ch.pipes = append(ch.pipes, r)
		writers = append(writers, w)
	}
	cmd.Stdout, cmd.Stderr = writers[0], writers[1]
	if err := c.spawner.start(cmd); err != nil {
		closeAll()
		return err
	}
	for _, w := range writers {
		w.Close() // the child holds its copies
	}
	ch.cmd, ch.pid = cmd, cmd.Process.Pid
	c.children = append(c.children, ch)
	for _, r := range ch.pipes {
		ch.readers.Add(1)
		go func() {
			defer ch.readers.Done()
			c.out.pump(s.Name, r, ch.tail)
		}()
	}
	go func() {
		err := cmd.Wait()
		ch.state = cmd.ProcessState
		if _, ok := errors.AsType[*exec.ExitError](err); !ok {
			ch.waitErr = err
		}
		close(ch.exited)
		c.exits <- ch
	}()
	return nil
}

// waitReady polls every health URL until each answers 200, a child exits,
// the ready timeout passes or ctx ends.
func (c *Cluster) waitReady(ctx context.Context) error {
	pollCtx, cancel := context.WithCancel(ctx)
	var pollers sync.WaitGroup
	defer func() {
		cancel()
		pollers.Wait()
	}()
	ready := make(chan *child, len(c.children))
	var mu sync.Mutex
	lastErr := map[*child]string{}
	pending := map[*child]bool{}
	for _, ch := range c.children {
		if ch.spec.HealthURL == "" {
			continue
		}
		pending[ch] = true
		pollers.Add(1)
		go func() {
			defer pollers.Done()
			t := time.NewTicker(c.opts.PollInterval)
			defer t.Stop()
			for {
				err := c.check(pollCtx, ch.spec.HealthURL)
				if err == nil {
					ready <- ch
					return
				}
				mu.Lock()
				lastErr[ch] = err.Error()
				mu.Unlock()
				select {
				case <-pollCtx.Done():
					return
				case <-t.C:
				}
			}
		}()
	}
	deadline := time.NewTimer(c.opts.ReadyTimeout)
	defer deadline.Stop()
	for len(pending) > 0 {
		select {
		case ch := <-ready:
			delete(pending, ch)
		case ch := <-c.exits:
			ch.reported = true
			c.drain(ch)
			return fmt.Errorf("launch: %w", ch.error(true))
		case <-ctx.Done():
			return fmt.Errorf("launch: interrupted while waiting for the children to be ready: %w", ctx.Err())
		case <-deadline.C:
			var b strings.Builder
			fmt.Fprintf(&b, "launch: not ready after %v:", c.opts.ReadyTimeout)
			mu.Lock()
			for _, ch := range c.children {
				if pending[ch] {
					fmt.Fprintf(&b, "\n  %s (%s, pid %d): %s", ch.spec.Name, ch.spec.Role, ch.pid, lastErr[ch])
					lines := ch.tail.lines()
					writeTail(&b, lines[max(0, len(lines)-5):])
				}
			}
			mu.Unlock()
			return errors.New(b.String())
		}
	}
	return nil
}

// check GETs url once: nil on 200.
func (c *Cluster) check(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}

// Children lists the children in start order.
func (c *Cluster) Children() []Child {
	out := make([]Child, len(c.children))
	for i, ch := range c.children {
		out[i] = Child{Spec: ch.spec, Pid: ch.pid}
	}
	return out
}

// Run waits until ctx ends or a child exits, then stops every child and
// waits for them all. A child that exited on its own is reported on the
// output and returned as a *ChildError. When ctx ends, Run returns nil if
// every child stopped within the grace period after SIGTERM, else an error
// naming those it had to kill.
func (c *Cluster) Run(ctx context.Context) error {
	select {
	case <-ctx.Done():
		c.logf("stopping %d processes", len(c.children))
		return c.stop()
	case ch := <-c.exits:
		ch.reported = true
		c.drain(ch)
		ce := ch.error(false)
		c.logf("%v", ce)
		c.logf("stopping the other processes")
		c.stop()
		return ce
	}
}

// Stop stops every child (SIGTERM, then SIGKILL after the grace period) and
// waits for them all, without waiting for Run's context: for a caller that
// gives up on a started cluster. It returns an error naming the children it
// had to kill.
func (c *Cluster) Stop() error { return c.stop() }

// drain gives an exited child's readers a moment to read what it wrote
// last, so its tail is complete (a process it started may still hold the
// pipes: then stop closes them).
func (c *Cluster) drain(ch *child) {
	done := make(chan struct{})
	go func() {
		ch.readers.Wait()
		close(done)
	}()
	t := time.NewTimer(500 * time.Millisecond)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

func (c *Cluster) logf(format string, a ...any) {
	c.out.line("launch", fmt.Sprintf(format, a...))
}

// stop ends every child: SIGTERM to each process group, a wait of up to
// the grace period for every child and group to be gone, SIGKILL to what
// is left; then it reaps every child and ends the output readers. It runs
// once; later calls return the first result.
func (c *Cluster) stop() error {
	c.stopOnce.Do(func() { c.stopErr = c.doStop() })
	return c.stopErr
}

func (c *Cluster) doStop() error {
	for _, ch := range c.children {
		signalGroup(ch.pid, syscall.SIGTERM)
	}
	deadline := time.Now().Add(c.opts.Grace)
	for _, ch := range c.children {
		t := time.NewTimer(time.Until(deadline))
		select {
		case <-ch.exited:
		case <-t.C:
		}
		t.Stop()
	}
	// Processes a child started may outlive it, in its group.
	waitGroupsGone(c.children, deadline, c.opts.PollInterval)
	var killed []string
	for _, ch := range c.children {
		leader := false
		select {
		case <-ch.exited:
		default:
			leader = true
		}
		if !groupAlive(ch.pid) && !leader {
			continue
		}
		signalGroup(ch.pid, syscall.SIGKILL)
		if leader {
			killed = append(killed, fmt.Sprintf("%s (pid %d)", ch.spec.Name, ch.pid))
		} else {
			c.logf("killed what %s left running in its process group", ch.spec.Name)
		}
	}
	if len(killed) > 0 {
		c.logf("killed after the %v grace period: %s", c.opts.Grace, strings.Join(killed, ", "))
	}
	for _, ch := range c.children {
		<-ch.exited
		if !ch.reported {
			ch.reported = true
			c.logf("%s (pid %d) exited: %s", ch.spec.Name, ch.pid, ch.status())
		}
	}
	// SIGKILL is prompt, but the kernel reaps a killed group's orphans on
	// its own time: wait a little for them, so the caller finds them gone.
	waitGroupsGone(c.children, time.Now().Add(2*time.Second), 10*time.Millisecond)
	c.endReaders()
	c.spawner.close()
	c.client.CloseIdleConnections()
	if len(killed) > 0 {
		return fmt.Errorf("launch: killed after the %v grace period: %s", c.opts.Grace, strings.Join(killed, ", "))
	}
	return nil
}

// endReaders waits for the output readers to reach the end of their pipes,
// then closes the pipes of those still reading (a write end held by a
// process outside the child's group) and waits for them to return.
func (c *Cluster) endReaders() {
	done := make(chan struct{})
	go func() {
		for _, ch := range c.children {
			ch.readers.Wait()
		}
		close(done)
	}()
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		for _, ch := range c.children {
			for _, p := range ch.pipes {
				p.Close() // wakes its reader with an error
			}
		}
		<-done
	}
	for _, ch := range c.children {
		for _, p := range ch.pipes {
			p.Close()
		}
	}
}

// signalGroup sends sig to the process group led by pid. Errors (the group
// is gone) are ignored: the caller checks what is left.
func signalGroup(pid int, sig syscall.Signal) {
	_ = syscall.Kill(-pid, sig)
}

// groupAlive reports whether any process is left in pid's process group.
// The group id stays reserved while any member lives, so it cannot name
// another process's group.
func groupAlive(pid int) bool {
	return syscall.Kill(-pid, 0) == nil
}

// waitGroupsGone polls until every child's process group is empty or the
// deadline passes.
func waitGroupsGone(children []*child, deadline time.Time, every time.Duration) {
	for {
		alive := false
		for _, ch := range children {
			if groupAlive(ch.pid) {
				alive = true
				break
			}
		}
		if !alive || !time.Now().Before(deadline) {
			return
		}
		time.Sleep(min(every, time.Until(deadline)))
	}
}

// spawner starts every child from one goroutine locked to its OS thread
// for the cluster's lifetime: Linux sends the parent-death signal when the
// thread that forked the child exits, and a Go runtime thread can exit
// (when a goroutine locked to it ends), which would kill a healthy child.
type spawner struct {
	reqs chan spawnReq
	done chan struct{}
}

type spawnReq struct {
	cmd *exec.Cmd
	err chan error
}

func newSpawner() *spawner {
	s := &spawner{reqs: make(chan spawnReq), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread() // only once no child is left: the thread lives on
		for r := range s.reqs {
			r.err <- r.cmd.Start()
		}
	}()
	return s
}

func (s *spawner) start(cmd *exec.Cmd) error {
	r := spawnReq{cmd: cmd, err: make(chan error, 1)}
	s.reqs <- r
	return <-r.err
}

// close ends the spawner's goroutine; call it once every child is reaped.
func (s *spawner) close() {
	close(s.reqs)
	<-s.done
}
