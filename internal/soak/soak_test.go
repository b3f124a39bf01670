//go:build soak

package soak

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/procstat"
	"github.com/pdkit/pdkit/internal/syncbuf"
	"github.com/pdkit/pdkit/internal/waitfor"
)

var (
	flagDuration = flag.Duration("soak.duration", 0, "how long the load runs (0: $PDKIT_SOAK_DURATION, else 10m)")
	flagSessions = flag.Int("soak.sessions", 60, "concurrent sessions")
	flagSeed     = flag.Uint64("soak.seed", 1, "seed of the request cases")
	flagSamples  = flag.String("soak.samples", "", "write every RSS and goroutine sample to this file (tab-separated: seconds into the load, series, value)")
)

const (
	defaultDuration = 10 * time.Minute
	numCases        = 64               // request cases, each with its reference
	diagnoseEvery   = 30 * time.Second // pdctl diagnose under load
	sampleEvery     = 2 * time.Second  // RSS and goroutines
	requestTimeout  = 2 * time.Minute  // one request, end to end
	flatTolerance   = 0.10             // RSS and goroutines: last window within 10% of the early one
	// setupBudget is what the test needs beyond the load: building the
	// tools, starting the cluster (generating the built-in model on a
	// fresh machine), the references, the last diagnose and the stop.
	setupBudget = 6 * time.Minute
)

// rampUp is how long the sessions take to arrive: 10s, less in a short
// run (at most a twelfth of it, before the first measured window).
func rampUp(d time.Duration) time.Duration { return min(10*time.Second, d/12) }

// soakDuration is -soak.duration, else $PDKIT_SOAK_DURATION, else 10m.
func soakDuration(t *testing.T) time.Duration {
	t.Helper()
	if *flagDuration > 0 {
		return *flagDuration
	}
	if s := os.Getenv("PDKIT_SOAK_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			t.Fatalf("PDKIT_SOAK_DURATION=%q: want a positive duration such as 2m", s)
		}
		return d
	}
	return defaultDuration
}

func TestSoak(t *testing.T) {
	d := soakDuration(t)
	if d < 20*time.Second {
		t.Fatalf("duration %v: want at least 20s (the windows are fifths of it, sampled every %v)", d, sampleEvery)
	}
	if dl, ok := t.Deadline(); ok && time.Until(dl) < d+setupBudget {
		t.Fatalf("the test deadline is in %v; a %v soak needs -timeout of at least %v", time.Until(dl).Round(time.Second), d, (d + setupBudget).Round(time.Minute))
	}
	sessions := *flagSessions
	if sessions < 1 {
		t.Fatalf("-soak.sessions %d: want at least 1", sessions)
	}
	dir := t.TempDir()
	pdserve, pdctl := buildTools(t, dir)
	cl := startCluster(t, pdserve, dir)
	t.Logf("cluster: router %s; %s", cl.router, cl.describe())

	cases := makeCases(*flagSeed)
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: sessions + 8}}
	defer hc.CloseIdleConnections()
	refs := make([]result, len(cases))
	start := time.Now()
	for i, c := range cases {
		ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
		r, err := c.do(ctx, hc, cl.router)
		cancel()
		if err != nil {
			t.Fatalf("reference of case %d (%s) alone: %v\n%s", i, c, err, cl.logTail())
		}
		refs[i] = r
	}
	t.Logf("references: %d cases alone in %v", len(cases), time.Since(start).Round(time.Millisecond))

	// The load, the samples and the diagnoses, for d.
	st := &stats{}
	mon := newMonitor(cl, hc)
	loadStart := time.Now()
	end := loadStart.Add(d)
	var wg sync.WaitGroup
	for s := range sessions {
		wg.Go(func() {
			// The sessions arrive over rampUp, as clients do, rather than
			// in one burst whose extra connections would idle out of
			// the servers' pools 90s later, inside the measured windows
			// of a short run. The ramp is a schedule in real time, not
			// a wait for a condition: a sleep is what keeps it.
			time.Sleep(time.Duration(s) * rampUp(d) / time.Duration(sessions))
			// Each session walks the cases from its own place, so the
			// mix in flight changes all the time.
			for k := s * 37; time.Now().Before(end); k++ {
				i := k % len(cases)
				ctx, cancel := context.WithTimeout(t.Context(), requestTimeout)
				t0 := time.Now()
				r, err := cases[i].do(ctx, hc, cl.router)
				cancel()
				st.add(i, cases[i], r, refs[i], err, time.Since(t0))
			}
		})
	}
	var diags []diagnosis
	var side sync.WaitGroup
	side.Go(func() { mon.run(loadStart, end) })
	side.Go(func() {
		for k := 1; ; k++ {
			at := loadStart.Add(time.Duration(k) * diagnoseEvery)
			if !at.Before(end) {
				return
			}
			// The soak's pacing: a diagnosis every diagnoseEvery of real
			// time, not a wait for a condition.
			time.Sleep(time.Until(at))
			dg := runDiagnose(t.Context(), pdctl, cl.router, at.Sub(loadStart))
			diags = append(diags, dg)
			ok, failed, mism, _ := st.counts()
			t.Logf("%v: %d requests ok, %d failed, %d differing; diagnose %s", dg.at.Round(time.Second), ok, failed, mism, dg.verdict())
		}
	})
	wg.Wait()
	side.Wait()
	loadTime := time.Since(loadStart)
	// Once more with the cluster idle: nothing may be left behind.
	final := runDiagnose(t.Context(), pdctl, cl.router, loadTime)
	final.idle = true
	diags = append(diags, final)

	// The report, then the verdicts.
	ok, failed, mism, tokens := st.counts()
	p50, p99 := st.latency()
	t.Logf("load: %d sessions for %v: %d requests ok, %d failed, %d differing from their reference; %d output tokens (%.0f/s); latency p50 %v, p99 %v",
		sessions, loadTime.Round(time.Second), ok, failed, mism, tokens, float64(tokens)/loadTime.Seconds(), p50, p99)
	for _, f := range st.firstFailures() {
		t.Errorf("failed request: %s", f)
	}
	for _, m := range st.firstMismatches() {
		t.Errorf("output differs from its reference: %s", m)
	}
	if failed > 0 || mism > 0 {
		t.Errorf("%d failed requests and %d outputs differing from their reference; want 0 and 0", failed, mism)
	}
	if ok == 0 {
		t.Errorf("no request completed")
	}
	healthy := 0
	for _, dg := range diags {
		if dg.healthy() {
			healthy++
			continue
		}
		t.Errorf("pdctl diagnose at %v%s: %s\n%s", dg.at.Round(time.Second), map[bool]string{true: " (idle, after the load)"}[dg.idle], dg.verdict(), dg.output)
	}
	t.Logf("pdctl diagnose: %d of %d healthy (every %v under load, then once idle)", healthy, len(diags), diagnoseEvery)
	if len(diags) < 2 {
		t.Errorf("pdctl diagnose ran %d times; want at least 2", len(diags))
	}
	for _, e := range mon.errors() {
		t.Errorf("sampling: %s", e)
	}
	a0, a1, b0, b1 := d/5, 2*d/5, 4*d/5, d
	t.Logf("flatness: mean over [%v, %v) against mean over [%v, %v], tolerance %.0f%%", a0, a1, b0, b1, 100*flatTolerance)
	for _, s := range mon.series() {
		early, n1 := s.mean(a0, a1)
		late, n2 := s.mean(b0, b1+sampleEvery)
		if n1 == 0 || n2 == 0 {
			t.Errorf("%s: %d and %d samples in the two windows; want some in each", s.name, n1, n2)
			continue
		}
		change := late/early - 1
		var fifths []string
		for k := range 5 {
			m, _ := s.mean(time.Duration(k)*d/5, time.Duration(k+1)*d/5)
			fifths = append(fifths, strconv.FormatFloat(m, 'f', 1, 64))
		}
		t.Logf("  %-22s %8.1f -> %8.1f %-3s (%+5.1f%%, %d and %d samples; mean per fifth of the run: %s)",
			s.name, early, late, s.unit, 100*change, n1, n2, strings.Join(fifths, ", "))
		if change > flatTolerance || change < -flatTolerance {
			t.Errorf("%s is not flat: mean %.1f %s over [%v, %v), %.1f %s over [%v, %v] (%+.1f%%; tolerance %.0f%%)",
				s.name, early, s.unit, a0, a1, late, s.unit, b0, b1, 100*change, 100*flatTolerance)
		}
	}
	if *flagSamples != "" {
		if err := mon.write(*flagSamples); err != nil {
			t.Error(err)
		}
	}
	for _, n := range mon.missing() {
		t.Logf("  %-22s not measured: %s", n.name, n.why)
	}
	cl.stop(t)
}

// buildTools builds pdserve and pdctl from this module into dir, as make
// build does, and returns their paths.
func buildTools(t *testing.T, dir string) (pdserve, pdctl string) {
	t.Helper()
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Fatal("no go command on PATH")
	}
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), goCmd, "build", "-o", dir+string(filepath.Separator), "./cmd/pdserve", "./cmd/pdctl")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pdserve ./cmd/pdctl: %v\n%s", err, out)
	}
	return filepath.Join(dir, "pdserve"), filepath.Join(dir, "pdctl")
}

// moduleRoot is the directory above the working directory holding go.mod.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// child is one server of the cluster, as launch's endpoint table lists it.
type child struct {
	role, name, url string
	pid             int
}

// cluster is a running pdserve launch.
type cluster struct {
	cmd      *exec.Cmd
	done     chan struct{} // closed when launch has exited
	waitErr  error
	log      string // launch's stderr: every server's output
	router   string
	children []child
	stopped  bool
}

// startCluster runs pdserve launch as make run does (its defaults, the
// built-in model), the router on a free port, and returns once it has
// printed its endpoints: every server answers /health. The test's cleanup
// stops it if the test has not.
func startCluster(t *testing.T, pdserve, dir string) *cluster {
	t.Helper()
	cl := &cluster{done: make(chan struct{}), log: filepath.Join(dir, "launch.log")}
	logf, err := os.Create(cl.log)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	stdout := &syncbuf.Buffer{}
	cl.cmd = exec.Command(pdserve, "launch", "--port", "0")
	cl.cmd.Env = defaultsEnv(os.Environ())
	cl.cmd.Stdout, cl.cmd.Stderr = stdout, logf
	if err := cl.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		cl.waitErr = cl.cmd.Wait()
		close(cl.done)
	}()
	t.Cleanup(func() {
		if !cl.stopped {
			cl.stop(t)
		}
	})
	// launch waits up to its --ready-timeout (2m) for the servers, after
	// generating the built-in model if this machine has none yet.
	table := regexp.MustCompile(`(?m)^(prefill|decode|router) +(\S+) +(http://127\.0\.0\.1:\d+) +(\d+)`)
	up := waitfor.Poll(4*time.Minute, func() bool {
		select {
		case <-cl.done:
			t.Fatalf("pdserve launch exited before the cluster was up: %v\n%s", cl.waitErr, cl.logTail())
		default:
		}
		return strings.Contains(stdout.String(), "curl -s")
	})
	if !up {
		t.Fatalf("pdserve launch printed no endpoints within 4m\n%s", cl.logTail())
	}
	for _, m := range table.FindAllStringSubmatch(stdout.String(), -1) {
		pid, _ := strconv.Atoi(m[4])
		cl.children = append(cl.children, child{role: m[1], name: m[2], url: m[3], pid: pid})
		if m[1] == "router" {
			cl.router = m[3]
		}
	}
	if len(cl.children) != 3 || cl.router == "" {
		t.Fatalf("launch's endpoints: want a prefill, a decode and a router, got:\n%s", stdout.String())
	}
	return cl
}

// defaultsEnv is environ without PD_* and PDCTL_* variables: the servers
// run with their defaults and pdctl with its own, whatever the caller's
// shell sets.
func defaultsEnv(environ []string) []string {
	var env []string
	for _, kv := range environ {
		if !strings.HasPrefix(kv, "PD_") && !strings.HasPrefix(kv, "PDCTL_") {
			env = append(env, kv)
		}
	}
	return env
}

func (cl *cluster) describe() string {
	var parts []string
	for _, c := range cl.children {
		parts = append(parts, fmt.Sprintf("%s %s (pid %d)", c.name, c.url, c.pid))
	}
	return strings.Join(parts, ", ")
}

// logTail is the end of the servers' output, for failure messages.
func (cl *cluster) logTail() string {
	b, err := os.ReadFile(cl.log)
	if err != nil {
		return "(no launch log: " + err.Error() + ")"
	}
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return "launch's output, last lines:\n" + string(b)
}

// stop interrupts launch as Ctrl-C does and requires it to stop every
// server and exit within its stop timeout.
func (cl *cluster) stop(t *testing.T) {
	t.Helper()
	cl.stopped = true
	select {
	case <-cl.done:
		t.Errorf("pdserve launch had exited before the stop: %v\n%s", cl.waitErr, cl.logTail())
		return
	default:
	}
	cl.cmd.Process.Signal(os.Interrupt)
	select {
	case <-cl.done:
	case <-time.After(45 * time.Second):
		cl.cmd.Process.Kill() // its servers die with it (launch sets Pdeathsig)
		<-cl.done
		t.Errorf("pdserve launch did not stop within 45s of SIGINT\n%s", cl.logTail())
	}
	var ee *exec.ExitError
	if cl.waitErr != nil && !(errors.As(cl.waitErr, &ee) && ee.ExitCode() == 130) {
		t.Errorf("pdserve launch stopped with %v; want exit 0 or 130\n%s", cl.waitErr, cl.logTail())
	}
	for _, c := range cl.children {
		if syscall.Kill(c.pid, 0) == nil {
			t.Errorf("%s (pid %d) still runs after launch exited", c.name, c.pid)
			syscall.Kill(c.pid, syscall.SIGKILL)
		}
	}
}

// A request case: one prompt, completion or chat, streamed or not, greedy.
type requestCase struct {
	chat, stream bool
	prompt       string
	maxTokens    int
}

func (c requestCase) String() string {
	kind := "completion"
	if c.chat {
		kind = "chat"
	}
	if c.stream {
		kind += " stream"
	}
	return fmt.Sprintf("%s, %d prompt words, max_tokens %d", kind, len(strings.Fields(c.prompt)), c.maxTokens)
}

// words make the prompts; the built-in model's tokenizer splits them into
// a few tokens each.
var words = strings.Fields(`the a of and to in is was he she it they we you that for on with as at by
from this have had not but what all were when there can an your which their said if do will each
about how up out them then many some so these would other into has more her two like him see time
could no make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much before go good new
write our used me man too any day same right look think also around another came come work three
word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should home
big give air line set own under read last never us left end along while might next sound below saw
something thought both few those always looked show large often together asked house don't world going
want school important until form food keep children feet land side without boy once animals life enough`)

// makeCases builds the request cases from seed: prompts of 3 to 150
// words, half of them extending one of four shared prefixes (so the prefix
// cache hits), each kind of request in turn, max_tokens from 8 to 256.
func makeCases(seed uint64) []requestCase {
	rng := rand.New(rand.NewPCG(seed, 0x50a4))
	text := func(n int) string {
		w := make([]string, n)
		for i := range w {
			w[i] = words[rng.IntN(len(words))]
		}
		return strings.Join(w, " ")
	}
	prefixes := make([]string, 4)
	for i := range prefixes {
		prefixes[i] = text(40 + rng.IntN(60))
	}
	maxTokens := []int{8, 16, 32, 64, 128, 256}
	cases := make([]requestCase, numCases)
	for i := range cases {
		c := requestCase{chat: i%4 >= 2, stream: i%2 == 1, maxTokens: maxTokens[rng.IntN(len(maxTokens))]}
		if rng.IntN(2) == 0 {
			c.prompt = prefixes[rng.IntN(len(prefixes))] + " " + text(3+rng.IntN(50))
		} else {
			c.prompt = text(3 + rng.IntN(148))
		}
		cases[i] = c
	}
	return cases
}

// result is what a request answered: the text, why it ended, and how many
// tokens it generated.
type result struct {
	text, finish string
	tokens       int
}

func (r result) String() string {
	text := r.text
	if len(text) > 80 {
		text = text[:80] + "..."
	}
	return fmt.Sprintf("%d tokens, finish %s, text %q", r.tokens, r.finish, text)
}

// do sends the case to the router and reads the whole answer: an HTTP
// status other than 200, a malformed answer, an error event or a stream
// cut before [DONE] is an error.
func (c requestCase) do(ctx context.Context, hc *http.Client, router string) (result, error) {
	body := map[string]any{"max_tokens": c.maxTokens, "temperature": 0}
	path := "/v1/completions"
	if c.chat {
		path = "/v1/chat/completions"
		body["messages"] = []map[string]string{{"role": "user", "content": c.prompt}}
	} else {
		body["prompt"] = c.prompt
	}
	if c.stream {
		body["stream"] = true
		body["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, err := json.Marshal(body)
	if err != nil {
		return result{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, router+path, bytes.NewReader(b))
	if err != nil {
		return result{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return result{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 2000))
		return result{}, fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	if !c.stream {
		var a answer
		if err := json.NewDecoder(resp.Body).Decode(&a); err != nil {
			return result{}, fmt.Errorf("reading the answer: %w", err)
		}
		if a.Error != nil {
			return result{}, fmt.Errorf("error in a 200 answer: %s", a.Error)
		}
		if len(a.Choices) != 1 {
			return result{}, fmt.Errorf("%d choices, want 1", len(a.Choices))
		}
		ch := a.Choices[0]
		r := result{text: ch.Text + ch.Message.Content, tokens: a.Usage.CompletionTokens}
		if ch.FinishReason != nil {
			r.finish = *ch.FinishReason
		}
		return r, nil
	}
	var r result
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			if line := sc.Text(); line != "" && !strings.HasPrefix(line, ":") {
				return result{}, fmt.Errorf("stream line %q is not an SSE data line", line)
			}
			continue
		}
		if data == "[DONE]" {
			r.text = text.String()
			return r, nil
		}
		var a answer
		if err := json.Unmarshal([]byte(data), &a); err != nil {
			return result{}, fmt.Errorf("stream event %q: %w", data, err)
		}
		if a.Error != nil {
			return result{}, fmt.Errorf("error event after %d tokens' text: %s", len(text.String()), a.Error)
		}
		for _, ch := range a.Choices {
			text.WriteString(ch.Text + ch.Delta.Content)
			if ch.FinishReason != nil {
				r.finish = *ch.FinishReason
			}
		}
		if a.Usage.CompletionTokens > 0 {
			r.tokens = a.Usage.CompletionTokens
		}
	}
	if err := sc.Err(); err != nil {
		return result{}, fmt.Errorf("stream cut: %w", err)
	}
	return result{}, errors.New("stream ended without [DONE]")
}

// answer is a completion or chat answer, or one event of either's stream.
type answer struct {
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
	Error json.RawMessage `json:"error"`
}

// stats counts the load's outcomes; the sessions add to it.
type stats struct {
	mu                   sync.Mutex
	ok, failed, mismatch int
	tokens               int
	failures, mismatches []string // the first few, for the report
	latencies            []time.Duration
}

const keepFirst = 20

func (s *stats) add(i int, c requestCase, got, want result, err error, took time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case err != nil:
		s.failed++
		if len(s.failures) < keepFirst {
			s.failures = append(s.failures, fmt.Sprintf("case %d (%s) after %v: %v", i, c, took.Round(time.Millisecond), err))
		}
	case got != want:
		s.mismatch++
		if len(s.mismatches) < keepFirst {
			s.mismatches = append(s.mismatches, fmt.Sprintf("case %d (%s):\n  got  %s\n  want %s", i, c, got, want))
		}
	default:
		s.ok++
		s.tokens += got.tokens
		s.latencies = append(s.latencies, took)
	}
}

func (s *stats) counts() (ok, failed, mismatch, tokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ok, s.failed, s.mismatch, s.tokens
}

func (s *stats) firstFailures() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.failures)
}

func (s *stats) firstMismatches() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.mismatches)
}

// latency is the p50 and p99 of the successful requests' end-to-end times.
func (s *stats) latency() (p50, p99 time.Duration) {
	s.mu.Lock()
	l := slices.Clone(s.latencies)
	s.mu.Unlock()
	if len(l) == 0 {
		return 0, 0
	}
	slices.Sort(l)
	at := func(q float64) time.Duration { return l[min(len(l)-1, int(q*float64(len(l))))].Round(time.Millisecond) }
	return at(0.50), at(0.99)
}

// diagnosis is one run of pdctl diagnose.
type diagnosis struct {
	at     time.Duration // since the load started
	idle   bool          // after the load
	code   int           // exit status; -1: it did not run
	output string
}

func (d diagnosis) healthy() bool { return d.code == 0 && strings.Contains(d.output, "healthy") }

func (d diagnosis) verdict() string {
	switch {
	case d.healthy():
		return "healthy"
	case d.code == 1:
		return "findings (exit 1)"
	case d.code < 0:
		return "did not run"
	}
	return fmt.Sprintf("exit %d", d.code)
}

// runDiagnose runs pdctl diagnose, with its default window, against the
// router.
func runDiagnose(ctx context.Context, pdctl, router string, at time.Duration) diagnosis {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, pdctl, "diagnose", "--router", router)
	cmd.Env = defaultsEnv(os.Environ())
	out, err := cmd.CombinedOutput()
	d := diagnosis{at: at, output: string(out)}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		d.code = ee.ExitCode()
	default:
		d.code, d.output = -1, err.Error()
	}
	return d
}

// A series is one process's samples of one quantity.
type series struct {
	name, unit string
	points     []point
}

type point struct {
	at time.Duration // since the load started
	v  float64
}

// mean is the mean of the samples in [from, to), and how many there are.
func (s *series) mean(from, to time.Duration) (float64, int) {
	var sum float64
	n := 0
	for _, p := range s.points {
		if p.at >= from && p.at < to {
			sum += p.v
			n++
		}
	}
	if n == 0 {
		return 0, 0
	}
	return sum / float64(n), n
}

// monitor samples every server's RSS (from /proc) and goroutine count:
// a prefill or decode server's from its goroutine profile (GET
// /debug/v1/stacks), the router's from go_goroutines on its /metrics when
// it exposes one.
type monitor struct {
	cl *cluster
	hc *http.Client

	mu    sync.Mutex
	byKey map[string]*series
	order []string
	errs  []string
	miss  map[string]string // series not measured, and why
}

func newMonitor(cl *cluster, hc *http.Client) *monitor {
	return &monitor{cl: cl, hc: hc, byKey: map[string]*series{}, miss: map[string]string{}}
}

// run samples every sampleEvery from start until end.
func (m *monitor) run(start, end time.Time) {
	for k := 0; ; k++ {
		at := start.Add(time.Duration(k) * sampleEvery)
		if at.After(end) {
			return
		}
		// The soak's pacing: a sample every sampleEvery of real time,
		// not a wait for a condition.
		time.Sleep(time.Until(at))
		m.sample(time.Since(start))
	}
}

func (m *monitor) sample(at time.Duration) {
	for _, c := range m.cl.children {
		if rss, err := residentKiB(c.pid); err != nil {
			m.fail("%s RSS at %v: %v", c.name, at.Round(time.Second), err)
		} else {
			m.add(c.name+" RSS", "MiB", at, rss/1024)
		}
		n, ok, err := m.goroutines(c)
		switch {
		case err != nil:
			m.fail("%s goroutines at %v: %v", c.name, at.Round(time.Second), err)
		case !ok:
			m.mu.Lock()
			m.miss[c.name+" goroutines"] = "its /metrics has no go_goroutines"
			m.mu.Unlock()
		default:
			m.add(c.name+" goroutines", "", at, n)
		}
	}
}

func (m *monitor) add(name, unit string, at time.Duration, v float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.byKey[name]
	if s == nil {
		s = &series{name: name, unit: unit}
		m.byKey[name] = s
		m.order = append(m.order, name)
	}
	s.points = append(s.points, point{at, v})
}

func (m *monitor) fail(format string, a ...any) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.errs) < keepFirst {
		m.errs = append(m.errs, fmt.Sprintf(format, a...))
	}
}

func (m *monitor) errors() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.errs)
}

func (m *monitor) series() []*series {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*series
	for _, k := range m.order {
		out = append(out, m.byKey[k])
	}
	return out
}

// write writes every sample to path, one per line: seconds into the
// load, series, value, tab-separated.
func (m *monitor) write(path string) error {
	var b strings.Builder
	for _, s := range m.series() {
		for _, p := range s.points {
			fmt.Fprintf(&b, "%.1f\t%s\t%g\n", p.at.Seconds(), s.name, p.v)
		}
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

type missing struct{ name, why string }

func (m *monitor) missing() []missing {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []missing
	for _, k := range slices.Sorted(maps.Keys(m.miss)) {
		if m.byKey[k] == nil {
			out = append(out, missing{k, m.miss[k]})
		}
	}
	return out
}

// goroutines reads c's goroutine count; false when c does not tell it.
func (m *monitor) goroutines(c child) (float64, bool, error) {
	if c.role == "router" {
		body, err := m.get(c.url + "/metrics")
		if err != nil {
			return 0, false, err
		}
		for line := range strings.Lines(body) {
			if rest, ok := strings.CutPrefix(line, "go_goroutines "); ok {
				v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
				return v, err == nil, err
			}
		}
		return 0, false, nil
	}
	body, err := m.get(c.url + "/debug/v1/stacks")
	if err != nil {
		return 0, false, err
	}
	first, _, _ := strings.Cut(body, "\n")
	rest, ok := strings.CutPrefix(first, "goroutine profile: total ")
	if !ok {
		return 0, false, fmt.Errorf("/debug/v1/stacks begins %q, not a goroutine profile", first)
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
	return v, err == nil, err
}

func (m *monitor) get(url string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := m.hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("GET %s: HTTP %d", url, resp.StatusCode)
	}
	return string(b), err
}

// residentKiB is process pid's resident set in KiB.
func residentKiB(pid int) (float64, error) {
	n, err := procstat.Resident(pid)
	return float64(n) / 1024, err
}
