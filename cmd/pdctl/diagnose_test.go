package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/clustertest"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// load keeps n streaming sessions going through base, each sending one
// short completion after another, until stop; stop returns the number of
// completions served whole.
func load(t *testing.T, base string, n int) (served func() int64, stop func()) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n, Proxy: nil}}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var done atomic.Int64
	for i := range n {
		wg.Go(func() {
			b, _ := json.Marshal(map[string]any{"prompt": fmt.Sprintf("session %d: once upon a time", i),
				"max_tokens": 6, "temperature": 0, "ignore_eos": true, "stream": true})
			for ctx.Err() == nil {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
				req.Header.Set("Content-Type", "application/json")
				resp, err := hc.Do(req)
				if err != nil {
					continue
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil && resp.StatusCode == http.StatusOK && bytes.Contains(body, []byte("[DONE]")) {
					done.Add(1)
				}
			}
		})
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			hc.CloseIdleConnections()
		})
	}
	t.Cleanup(stop)
	return done.Load, stop
}

// newClusterKV is newCluster with kvTokens KV tokens per rank.
func newClusterKV(t *testing.T, kvTokens int) *cluster {
	t.Helper()
	saved := testConfig
	defer func() { testConfig = saved }()
	testConfig.KVTokens = kvTokens
	return newCluster(t)
}

// TestDiagnoseHealthyUnderLoad: a healthy cluster serving 60 streaming
// sessions at once is diagnosed healthy, run after run. Its decode pool
// (128 tokens a rank) holds a few requests at a time, so the PD queues are
// long but moving: no queue is stuck.
func TestDiagnoseHealthyUnderLoad(t *testing.T) {
	c := newCluster(t)
	served, stop := load(t, c.router, 60)
	waitfor.For(t, "the load served 60 completions", 20*time.Second, func() bool { return served() >= 60 })
	for run := range 3 {
		before := served()
		code, stdout, stderr := c.pdctl(t, false, "diagnose", "--window", "2s", "--interval", "500ms")
		if code != exitOK || stdout != "healthy\n" {
			t.Fatalf("run %d: exit %d\nstdout:\n%s\nstderr:\n%s", run, code, stdout, stderr)
		}
		if want := "sampling 2 servers every 500ms for 2s…\n5 samples over "; !strings.HasPrefix(stderr, want) {
			t.Errorf("run %d: stderr %q, want it to start with %q", run, stderr, want)
		}
		if served() == before {
			t.Errorf("run %d: no completion served while diagnose ran", run)
		}
	}
	stop()
	t.Logf("%d completions served", served())
}

// TestDiagnoseQuietUnder100Streams: a hundred streaming sessions at once
// take the decode's pool (128 tokens a rank) and queue the rest for its
// memory: load, not sickness. diagnose raises nothing at all, slowness
// included (the steps are timed per batch size, so a bigger batch is not
// a slower server), run after run. The test waits for rooms queued for
// the decode's memory, not for a full pool: the decode keeps room for
// its requests' growth, and the prefill's pace decides how close to full
// the pool comes (on a quiet machine it touches 90% a few times in 15 s,
// on a loaded one it may never).
func TestDiagnoseQuietUnder100Streams(t *testing.T) {
	c := newCluster(t)
	served, stop := load(t, c.router, 100)
	defer stop()
	waitfor.For(t, "rooms queued for the decode's memory", 30*time.Second, func() bool {
		for _, es := range c.decode.eng.PD().QueueEntries() {
			for _, e := range es {
				if e.Position > 0 {
					return true
				}
			}
		}
		return false
	})
	waitfor.For(t, "the load served 100 completions", 30*time.Second, func() bool { return served() >= 100 })
	for run := range 2 {
		if code, stdout, stderr := c.pdctl(t, false, "diagnose", "--window", "2s", "--interval", "500ms"); code != exitOK || stdout != "healthy\n" {
			t.Fatalf("run %d: exit %d\nstdout:\n%s\nstderr:\n%s", run, code, stdout, stderr)
		}
	}
	t.Logf("%d completions served", served())
}

// TestDiagnoseUsage: bad flags and a cluster that does not answer at all
// cannot run (exit 2).
func TestDiagnoseUsage(t *testing.T) {
	tests := []struct {
		args   []string
		stderr string
	}{
		{[]string{"diagnose", "--interval", "0s"}, "pdctl: --window and --interval must be positive\nRun 'pdctl diagnose --help' for usage.\n"},
		{[]string{"diagnose", "--window", "1s", "--interval", "2s"}, "pdctl: --interval 2s is longer than --window 1s\nRun 'pdctl diagnose --help' for usage.\n"},
		{[]string{"--server", "http://127.0.0.1:1", "diagnose", "--window", "20ms", "--interval", "10ms"},
			"sampling 1 server every 10ms for 20ms…\npdctl: cannot run: no server answered: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\n"},
		{[]string{"--router", "http://127.0.0.1:1", "diagnose"},
			"pdctl: cannot run: discovering the cluster behind http://127.0.0.1:1: GET http://127.0.0.1:1/debug/v1/cluster: dial tcp 127.0.0.1:1: connect: connection refused\n"},
	}
	for _, tt := range tests {
		code, stdout, stderr := runArgs(t, tt.args...)
		if code != exitNoRun || stdout != "" || stderr != tt.stderr {
			t.Errorf("%q: exit %d\nstdout: %q\nstderr: %q\nwant:   %q", tt.args, code, stdout, stderr, tt.stderr)
		}
	}
}

// TestDiagnoseBootstrapAbortCrash: with bootstrap-abort-crash on at the
// prefill, the mass-abort drill kills the prefill's control loop; with new
// requests still arriving, diagnose names the dead loop on the dead
// ranks, the decode's stuck transfer queue and the remedy, and exits 1.
// The servers' PD timeouts (a minute, the heartbeat's included: a dead
// control loop answers no heartbeat, and the decode would otherwise fail
// the rooms as peer-lost within 3s, mid-window on a busy machine) outlast
// the window, so the stuck rooms stay put while they are sampled.
func TestDiagnoseBootstrapAbortCrash(t *testing.T) {
	saved := testConfig
	testConfig.PD.HeartbeatTimeout = time.Minute
	c := newClusterKV(t, 4096)
	testConfig = saved
	ctx := t.Context()
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetFault(ctx, "bootstrap-abort-crash", true); err != nil {
		t.Fatal(err)
	}

	// The drill: 20 streaming sessions through the router, all cancelled
	// at once.
	var cancels []func()
	for i := range 20 {
		cancels = append(cancels, send(t, c.router, map[string]any{
			"prompt": fmt.Sprintf("drill %d: a long story about the sea and the ships and the sailors", i), "max_tokens": 200,
			"temperature": 0, "ignore_eos": true, "stream": true}))
	}
	waitfor.For(t, "the drill's sessions at the decode", 10*time.Second, func() bool {
		return pdTotal(t, c.decode) > 0
	})
	var wg sync.WaitGroup
	for _, cancel := range cancels {
		wg.Go(cancel)
	}
	wg.Wait()

	// Whether or not a drill session went while its decode half waited
	// for KV, this one surely does: sent to the decode alone, it waits in
	// its transfer queue for KV no prefill will send, and its client goes.
	held := send(t, c.decode.ts.URL, map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0,
		"ignore_eos": true, "bootstrap_room": 4242, "bootstrap_url": c.registry})
	waitfor.For(t, "the held session in the decode's transfer queue", 10*time.Second, func() bool {
		return pdCounts(t, c.decode, debug.PDQueueTransfer) > 0
	})
	held()
	var dead []int
	// Both decode ranks held the room, and each sends ABORT to its prefill
	// peer: every prefill rank's loop dies.
	waitfor.For(t, "the prefill's control loops dead", 10*time.Second, func() bool {
		dead = deadRanks(t, c)
		return len(dead) == c.prefill.eng.View().Ranks()
	})

	// New requests still arrive; they wait in the decode's transfer queue.
	for i := range 4 {
		send(t, c.router, map[string]any{"prompt": fmt.Sprintf("new %d: once upon a time", i), "max_tokens": 4,
			"temperature": 0, "ignore_eos": true, "stream": true})
	}
	// All four on every decode rank, and the queue settled, before the
	// window opens: a drill room whose KV was still arriving (the prefill
	// sends chunks with its control loop dead) would leave the queue during
	// the window and make it look as if it moved.
	var settled int
	var since time.Time
	waitfor.For(t, "the decode's transfer queue holding the new requests, settled", 15*time.Second, func() bool {
		n := pdCounts(t, c.decode, debug.PDQueueTransfer)
		if n != settled {
			settled, since = n, time.Now()
		}
		return n >= 4*c.decode.eng.View().Ranks() && time.Since(since) >= time.Second
	})

	start := time.Now()
	code, stdout, stderr := c.pdctl(t, false, "diagnose", "--window", "2s", "--interval", "500ms", "--json")
	took := time.Since(start)
	if code != exitFindings {
		t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitFindings, stdout, stderr)
	}
	if took > 10*time.Second {
		t.Errorf("diagnose took %v", took)
	}
	var findings []diag.Finding
	if err := json.Unmarshal([]byte(stdout), &findings); err != nil {
		t.Fatalf("the JSON output: %v\n%s", err, stdout)
	}
	// The loops stay dead: the ranks read now are those diagnose saw.
	dead = deadRanks(t, c)
	var loops []int
	stuck := false
	for _, f := range findings {
		switch {
		case f.Rule == "control-loop-dead":
			if f.Server != "PREFILL" || f.Severity != diag.Critical || f.Rank == nil {
				t.Fatalf("control-loop-dead on %s (%v)", f.Where(), f.Severity)
			}
			loops = append(loops, *f.Rank)
			if !strings.Contains(f.Remedy, "restart the prefill server PREFILL") {
				t.Errorf("control-loop-dead remedy: %q", f.Remedy)
			}
		case f.Server == "DECODE" && f.Rule == "pd-queue-stuck" && slices.Contains(f.Evidence, diag.Evidence{Key: "queue", Value: "transfer"}),
			f.Server == "DECODE" && f.Rule == "pd-entry-overdue":
			stuck = true
			if !strings.Contains(f.Remedy, "abort") {
				t.Errorf("%s remedy: %q", f.Rule, f.Remedy)
			}
		}
	}
	slices.Sort(loops)
	if !slices.Equal(loops, dead) {
		t.Errorf("control-loop-dead on prefill ranks %v, the dead ones are %v\n%s", loops, dead, stdout)
	}
	if !stuck {
		t.Errorf("no stuck decode transfer queue in the findings:\n%s", stdout)
	}
	if !strings.HasPrefix(stderr, "sampling 2 servers every 500ms for 2s…\n") || !strings.Contains(stderr, "pdctl: diagnose: ") {
		t.Errorf("stderr: %q", stderr)
	}
	t.Logf("diagnose took %v: %d findings", took.Round(time.Millisecond), len(findings))

	// The same, piped: a tab-separated line per finding, with the remedy.
	code, stdout, _ = c.pdctl(t, false, "diagnose", "--window", "500ms", "--interval", "250ms")
	if code != exitFindings {
		t.Fatalf("piped: exit %d", code)
	}
	for _, line := range strings.Split(strings.TrimSuffix(stdout, "\n"), "\n") {
		cells := strings.Split(line, "\t")
		if len(cells) != 7 {
			t.Errorf("piped line of %d cells: %q", len(cells), line)
		}
	}
	if want := "critical\tcontrol-loop-dead\tPREFILL\t" + fmt.Sprint(dead[0]) + "\t"; !strings.Contains(stdout, want) {
		t.Errorf("piped output lacks %q:\n%s", want, stdout)
	}

	// On a terminal: a block per finding, the remedy last.
	code, stdout, _ = c.pdctl(t, true, "diagnose", "--window", "500ms", "--interval", "250ms")
	want := "critical control-loop-dead PREFILL rank " + fmt.Sprint(dead[0]) + ": the prefill control loop of rank " + fmt.Sprint(dead[0]) + " is dead: "
	if code != exitFindings || !strings.Contains("\n"+stdout, "\n"+want) || !strings.Contains(stdout, "\n  exit_reason: ") ||
		!strings.Contains(stdout, "\n  remedy: restart the prefill server PREFILL") || !strings.Contains(stdout, "\n\ncritical ") {
		t.Errorf("terminal: exit %d, want a block starting %q:\n%s", code, want, stdout)
	}
}

// pdTotal sums every queue of every rank of n.
func pdTotal(t *testing.T, n *node) int {
	total := 0
	for _, q := range debug.PDQueues {
		total += pdCounts(t, n, q)
	}
	return total
}

// deadRanks lists the prefill ranks whose control loop is dead.
func deadRanks(t *testing.T, c *cluster) []int {
	r, err := client.New(c.prefill.ts.URL, "", nil).PD(t.Context(), "")
	if err != nil {
		t.Fatal(err)
	}
	var dead []int
	for _, rk := range r.Ranks {
		if !rk.Socket.Alive {
			dead = append(dead, rk.Rank)
		}
	}
	slices.Sort(dead)
	return dead
}

// TestDiagnoseWedgedOutput: the exact findings of a wedged cluster, piped
// and on a terminal: the dead loops first, each naming the decode rooms
// that wait on it, then the stuck transfer queues, then the fault switch
// that explains them. Values that change from
// run to run (times, ages, the window's span, message counts) are masked.
func TestDiagnoseWedgedOutput(t *testing.T) {
	c := newWedged(t)
	const (
		crash   = "CRASH"
		remedyP = "REMEDYP"
		remedyD = "REMEDYD"
	)
	loop := func(r string) string {
		return "critical\tcontrol-loop-dead\tPREFILL\t" + r + "\tthe prefill control loop of rank " + r + " is dead: " + crash +
			"\trole=prefill; endpoint=PREFILL-RANK" + r + "; alive=false; exit_reason=" + crash + "; last_message=*; messages=*; " +
			"handler_errors=1; handler_panics=0; recv_errors=0; queues=none; last_error=" + crash +
			"; peer_rooms=aborting on DECODE rank " + r + " (ABORT not acked): 9; transfer on DECODE rank " + r + ": 10; seen=*\t" + remedyP + "\n"
	}
	stuck := func(r string) string {
		return "critical\tpd-queue-stuck\tDECODE\t" + r + "\tthe transfer queue of decode rank " + r + " holds 1 room and none left it in *" +
			"\tqueue=transfer; count=1 (first sample 1); oldest=*; rooms=10; window=*; seen=*\t" + remedyD + "\n"
	}
	const faultOff = "unless a drill needs it, switch it off (pdctl fault off bootstrap-abort-crash --server PREFILL); a server started with --fault keeps it across restarts until the flag is removed."
	switchOn := "warning\tfault-switch-on\tPREFILL\t-\tthe prefill server runs with the fault switch on: bootstrap-abort-crash" +
		"\tbootstrap-abort-crash=the prefill control loop treats ABORT as an unknown message and exits (the mass-abort wedge); seen=*\t" + faultOff + "\n"
	piped := loop("0") + loop("1") + stuck("0") + stuck("1") + switchOn
	loopBlock := func(r string) string {
		return "critical control-loop-dead PREFILL rank " + r + ": the prefill control loop of rank " + r + " is dead: " + crash + "\n" +
			"  role: prefill\n  endpoint: PREFILL-RANK" + r + "\n  alive: false\n  exit_reason: " + crash + "\n  last_message: *\n" +
			"  messages: *\n  handler_errors: 1\n  handler_panics: 0\n  recv_errors: 0\n  queues: none\n  last_error: " + crash + "\n" +
			"  peer_rooms: aborting on DECODE rank " + r + " (ABORT not acked): 9; transfer on DECODE rank " + r + ": 10\n" +
			"  seen: *\n  remedy: " + remedyP + "\n"
	}
	stuckBlock := func(r string) string {
		return "critical pd-queue-stuck DECODE rank " + r + ": the transfer queue of decode rank " + r + " holds 1 room and none left it in *\n" +
			"  queue: transfer\n  count: 1 (first sample 1)\n  oldest: *\n  rooms: 10\n  window: *\n  seen: *\n  remedy: " + remedyD + "\n"
	}
	tty := loopBlock("0") + "\n" + loopBlock("1") + "\n" + stuckBlock("0") + "\n" + stuckBlock("1") + "\n" +
		"warning fault-switch-on PREFILL: the prefill server runs with the fault switch on: bootstrap-abort-crash\n" +
		"  bootstrap-abort-crash: the prefill control loop treats ABORT as an unknown message and exits (the mass-abort wedge)\n" +
		"  seen: *\n  remedy: " + faultOff + "\n"
	wantErr := "sampling 2 servers every 200ms for 600ms…\n* samples over *\npdctl: diagnose: 5 findings (4 critical, 1 warning)\n"
	mask := strings.NewReplacer(crash, "control loop: unknown message type ABORT (fault bootstrap-abort-crash): zmqlink: handler ended the receive loop", remedyP, "restart the prefill server PREFILL; its rooms cannot progress until then. The exit reason names the fault bootstrap-abort-crash: switch it off (pdctl fault off bootstrap-abort-crash --server PREFILL) before the restart.", remedyD, "the decode waits for KV that the prefill does not send (the mass-abort wedge): check the prefill peer's control loop (control-loop-dead) and the prefill's bootstrap queue, abort the stuck rooms (pdctl abort --rooms-from-queue), then restart the prefill server.")
	volatile := regexp.MustCompile(`((?:last_message|messages|oldest|window)(?:=|: ))[^;\t\n]*|(left it in )[0-9.]+m?s`)
	for _, tc := range []struct {
		tty  bool
		want string
	}{{false, piped}, {true, tty}} {
		code, stdout, stderr := c.pdctl(t, tc.tty, "diagnose", "--window", "600ms", "--interval", "200ms")
		stdout = volatile.ReplaceAllString(stdout, "$1$2*")
		stderr = regexp.MustCompile(`(?m)^[0-9]+ samples over [0-9.]+m?s$`).ReplaceAllString(stderr, "* samples over *")
		want := mask.Replace(tc.want)
		if code != exitFindings || stdout != want || stderr != wantErr {
			t.Errorf("tty %v: exit %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s", tc.tty, code, stdout, want, stderr)
		}
	}
}

// diagnoseJSON runs diagnose --json on c with extra flags and returns the
// exit code and the findings by rule, server and rank ("rule SERVER rank",
// rank null for the whole server).
func diagnoseJSON(t *testing.T, c *cluster, extra ...string) (exitCode, []diag.Finding, []string) {
	t.Helper()
	args := append([]string{"diagnose", "--window", "600ms", "--interval", "200ms", "--json"}, extra...)
	code, stdout, stderr := c.pdctl(t, false, args...)
	var findings []diag.Finding
	if err := json.Unmarshal([]byte(stdout), &findings); err != nil {
		t.Fatalf("exit %d: the JSON output: %v\n%s\nstderr:\n%s", code, err, stdout, stderr)
	}
	var keys []string
	for _, f := range findings {
		rank := "null" // as the JSON has it for the whole server
		if f.Rank != nil {
			rank = itoa(*f.Rank)
		}
		keys = append(keys, fmt.Sprintf("%s %s %s", f.Rule, f.Server, rank))
	}
	return code, findings, keys
}

// TestDiagnoseStalledRank: with stall-last-rank on at the decode, its rank
// 0 waits in a control collective (the step input's broadcast) that rank 1
// never enters. A plain diagnose (its default window and thresholds),
// started as soon as rank 0 waits, names it within 10 s of the switch:
// the stalled engine, rank-divergence on rank 0 with each rank's loop,
// step, phase and where it is (rank 0 in control seq N Broadcast, rank 1 in
// no collective after seq N-1), the switch, and the remedy that switches
// it off. The exact output, piped, with the values that change from run to
// run masked.
func TestDiagnoseStalledRank(t *testing.T) {
	c := newCluster(t)
	on := time.Now()
	if _, err := client.New(c.decode.ts.URL, "", nil).SetFault(t.Context(), "stall-last-rank", true); err != nil {
		t.Fatal(err)
	}
	var seq uint64
	waitfor.For(t, "decode rank 0 waiting in a control collective", 10*time.Second, func() bool {
		col, err := client.New(c.decode.ts.URL, "", nil).Collectives(t.Context())
		w := col.Comm(debug.CommControl).Rank(0)
		if err != nil || w == nil || w.Waiting == nil || w.Waiting.DurationMS < 200 {
			return false // not yet, or a passing wait before the switch held rank 1
		}
		seq = w.Waiting.Seq
		return true
	})
	code, stdout, stderr := c.pdctl(t, false, "diagnose")
	if took := time.Since(on); took > 10*time.Second {
		t.Errorf("diagnose answered %v after the switch, want within 10s", took)
	}
	const (
		doc      = "the highest TP rank stops before its next collective until switched off; its peers wait in the collective"
		stalled  = "the engine loop is stuck: read the ranks' stacks (pdctl bundle, or GET DECODE/debug/v1/stacks?rank=N) and the collectives (rank-divergence); a fault switch such as stall-last-rank holds a rank on purpose (fault-switch-on); restart the server if it does not move."
		divergeR = "the fault stall-last-rank holds the highest TP rank before its next collective on purpose: switch it off (pdctl fault off stall-last-rank --server DECODE) and the ranks meet again; to keep the evidence, capture a bundle (pdctl bundle -o FILE.tar.gz) with the flight recorders and stacks first."
		faultR   = "unless a drill needs it, switch it off (pdctl fault off stall-last-rank --server DECODE); a server started with --fault keeps it across restarts until the flag is removed."
	)
	want := "critical\tengine-stalled\tDECODE\t-\tno rank of the decode server finished a step in *\t" +
		"window=* over * samples (threshold 1s); ranks=rank 0 at step * (idle, last step ended * before the sample), waits in control seq N Broadcast (input) for *; " +
		"rank 1 at step * (idle, last step ended * before the sample), not in a collective; seen=*\t" + stalled + "\n" +
		"critical\trank-divergence\tDECODE\t0\trank 0 waits in control seq N Broadcast (input) for * while rank 1 is not in a collective (last control seq M)\t" +
		"rank 0=lockstep loop, step * (idle), waits in control seq N Broadcast (input) for * (threshold 2s); " +
		"rank 1=lockstep loop, step * (idle), not in a collective (control: last entered seq M, last completed M; forward: last entered seq 0, last completed 0); " +
		"fault switch=stall-last-rank on: " + doc + "; seen=*\t" + divergeR + "\n" +
		"warning\tfault-switch-on\tDECODE\t-\tthe decode server runs with the fault switch on: stall-last-rank\tstall-last-rank=" + doc + "; seen=*\t" + faultR + "\n"
	want = strings.NewReplacer("seq N", fmt.Sprintf("seq %d", seq), "seq M", fmt.Sprintf("seq %d", seq-1), "completed M", fmt.Sprintf("completed %d", seq-1)).Replace(want)
	volatile := regexp.MustCompile(`(for |ended |a step in |window=)[0-9.]+(?:µs|ms|s)|(over |step )[0-9]+`)
	got := volatile.ReplaceAllString(stdout, "$1$2*")
	stderr = regexp.MustCompile(`(?m)^[0-9]+ samples over [0-9.]+m?s$`).ReplaceAllString(stderr, "* samples over *")
	wantErr := "sampling 2 servers every 1s for 5s…\n* samples over *\npdctl: diagnose: 3 findings (2 critical, 1 warning)\n"
	if code != exitFindings || got != want || stderr != wantErr {
		t.Errorf("exit %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s", code, got, want, stderr)
	}
}

// TestDiagnoseDecodeLoopDead: with pd-loop-exit on at the decode, the first
// KV chunk ends each decode rank's KV loop; diagnose names both dead loops,
// the switch the exit reason names, and the switch itself.
func TestDiagnoseDecodeLoopDead(t *testing.T) {
	c := newCluster(t)
	if _, err := client.New(c.decode.ts.URL, "", nil).SetFault(t.Context(), "pd-loop-exit", true); err != nil {
		t.Fatal(err)
	}
	send(t, c.router, map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": true})
	waitfor.For(t, "the decode's KV loops dead", 10*time.Second, func() bool {
		pd, err := client.New(c.decode.ts.URL, "", nil).PD(t.Context(), "")
		return err == nil && len(pd.Ranks) == 2 && !pd.Ranks[0].Socket.Alive && !pd.Ranks[1].Socket.Alive
	})
	code, findings, keys := diagnoseJSON(t, c)
	var dead []string
	for i, k := range keys {
		if strings.HasPrefix(k, "control-loop-dead ") {
			dead = append(dead, k)
			if f := findings[i]; !strings.Contains(f.Summary, "the decode KV loop of rank") ||
				!strings.Contains(f.Remedy, "switch it off (pdctl fault off pd-loop-exit --server DECODE)") {
				t.Errorf("finding %s: %q / %q", k, f.Summary, f.Remedy)
			}
		}
	}
	if want := []string{"control-loop-dead DECODE 0", "control-loop-dead DECODE 1"}; code != exitFindings || !slices.Equal(dead, want) ||
		!slices.Contains(keys, "fault-switch-on DECODE null") {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
}

// TestDiagnoseRequestsFailing: requests routed while the prefill drops
// every TRANSFER_INFO wait in its bootstrap queue until its bootstrap
// timeout (1.5s here) fails them, inside the diagnose window; the router
// answers each with the prefill's error. Diagnose is not healthy: it
// names the failures on the router (its upstream errors, all of the
// requests it finished) and on the prefill (by reason and queue), each
// about the whole server, with the fault switch that caused them.
func TestDiagnoseRequestsFailing(t *testing.T) {
	saved := testConfig
	testConfig.PD.BootstrapTimeout = 1500 * time.Millisecond
	c := newCluster(t)
	testConfig = saved
	if code, _, errOut := c.pdctl(t, false, "--server", c.prefill.ts.URL, "fault", "on", "drop-transfer-info"); code != exitOK {
		t.Fatalf("fault on: exit %d: %s", code, errOut)
	}
	for i := range 2 {
		send(t, c.router, map[string]any{"prompt": fmt.Sprintf("request %d", i), "max_tokens": 4, "temperature": 0})
	}
	waitfor.For(t, "both requests in the prefill's bootstrap queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 4 // 2 rooms on 2 ranks
	})
	code, findings, keys := diagnoseJSON(t, c, "--window", "4s", "--interval", "500ms")
	if code != exitFindings || !slices.Contains(keys, "requests-failing ROUTER null") || !slices.Contains(keys, "requests-failing PREFILL null") ||
		!slices.Contains(keys, "fault-switch-on PREFILL null") {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
	for _, f := range findings {
		if f.Rule != "requests-failing" {
			continue
		}
		if f.Severity != diag.Critical {
			t.Errorf("%s: severity %v, want critical", f.Where(), f.Severity)
		}
		want := map[string][]diag.Evidence{
			"ROUTER":  {{Key: "failed", Value: "2 of 2 (100%)"}, {Key: "outcomes", Value: "upstream_error=2"}},
			"PREFILL": {{Key: "by reason", Value: "timeout=2"}, {Key: "by queue", Value: "bootstrap=2"}},
		}[f.Server]
		for _, e := range want {
			if !slices.Contains(f.Evidence, e) {
				t.Errorf("%s: evidence %+v lacks %+v", f.Where(), f.Evidence, e)
			}
		}
		if f.Server == "PREFILL" && !strings.Contains(f.Remedy, "--bootstrap-timeout") {
			t.Errorf("prefill remedy %q", f.Remedy)
		}
	}
}

// A decode that stores KV in another element type than its prefill fails
// every request at the handshake; diagnose names the pair, both values and
// the flag, though the window holds no request at all.
func TestDiagnoseConfigMismatch(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	c := newClusterWith(t, m, clustertest.Options{Decode: func(c *serve.Config) { c.KVType = kernels.BF16 }})
	start := time.Now()
	code, findings, keys := diagnoseJSON(t, c, "--window", "1s", "--interval", "500ms")
	t.Logf("named in %v: %q", time.Since(start).Round(time.Millisecond), keys)
	if code != exitFindings || !slices.Contains(keys, "config-mismatch DECODE null") {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
	for _, f := range findings {
		if f.Rule != "config-mismatch" {
			continue
		}
		if f.Severity != diag.Critical || !strings.Contains(f.Summary, "kv_dtype") || !strings.Contains(f.Remedy, "--kv-dtype") ||
			!slices.Contains(f.Evidence, diag.Evidence{Key: "kv_dtype", Value: `prefill "f32", decode "bf16"`}) {
			t.Errorf("finding %+v", f)
		}
	}
}

// A router that stops answering is named, and its servers are still
// sampled, directly, as pdctl last discovered them through it.
func TestDiagnoseRouterGone(t *testing.T) {
	c := newCluster(t)
	if code, _, keys := diagnoseJSON(t, c, "--window", "200ms", "--interval", "200ms"); code != exitOK {
		t.Fatalf("before: exit %d, %q", code, keys)
	}
	c.routerServer.Close()
	code, findings, keys := diagnoseJSON(t, c, "--window", "1s", "--interval", "500ms")
	if code != exitFindings || len(findings) != 1 || findings[0].Rule != "router-unreachable" || findings[0].Server != "ROUTER" {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
	var servers bool
	for _, e := range findings[0].Evidence {
		servers = servers || (e.Key == "servers" && strings.Contains(e.Value, "sampled directly"))
	}
	if !servers {
		t.Errorf("evidence %+v", findings[0].Evidence)
	}
	// With no discovery kept, diagnose cannot run.
	c.router = "http://127.0.0.1:1"
	if code, _, stderr := c.pdctl(t, false, "diagnose", "--window", "200ms", "--interval", "200ms"); code != exitUsage {
		t.Errorf("a router never discovered: exit %d, want 2: %s", code, stderr)
	}
}

// A model file written over in place under a running cluster: the weights
// are mapped from it, so outputs change; diagnose names the file on each
// server that serves it.
func TestDiagnoseModelChangedUnderTheCluster(t *testing.T) {
	path, m := testmodel.Own(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	c := newClusterWith(t, m, clustertest.Options{})
	if code, _, keys := diagnoseJSON(t, c, "--window", "200ms", "--interval", "200ms"); code != exitOK {
		t.Fatalf("before: exit %d, %q", code, keys)
	}
	// Written over in place, as a careless copy does: the same size, a
	// later modification time.
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(path, later, later); err != nil {
		t.Fatal(err)
	}
	// The servers check their file at most every 5 s, when their
	// settings are read: the window spans that.
	code, findings, keys := diagnoseJSON(t, c, "--window", "6s", "--interval", "1s")
	if code != exitFindings || !slices.Contains(keys, "model-identity PREFILL null") || !slices.Contains(keys, "model-identity DECODE null") {
		t.Fatalf("exit %d, findings %q", code, keys)
	}
	for _, f := range findings {
		if f.Rule == "model-identity" && (f.Severity != diag.Critical || !strings.Contains(f.Summary, "after the server loaded it")) {
			t.Errorf("%+v", f)
		}
	}
}

// TestDiagnoseRehash: a byte of the weights changed between the sampled
// check's blocks, the file's size and time kept, is invisible to the
// servers' periodic check; diagnose --rehash has every server rehash its
// whole file first and names the change on both.
func TestDiagnoseRehash(t *testing.T) {
	path, m := testmodel.Own(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	c := newClusterWith(t, m, clustertest.Options{})
	testmodel.FlipBetweenSamples(t, path)
	if code, _, keys := diagnoseJSON(t, c, "--window", "200ms", "--interval", "200ms"); code != exitOK {
		t.Fatalf("without --rehash the change is between the samples: exit %d, %q", code, keys)
	}
	code, findings, keys := diagnoseJSON(t, c, "--rehash", "--window", "200ms", "--interval", "200ms")
	if code != exitFindings || !slices.Contains(keys, "model-identity PREFILL null") || !slices.Contains(keys, "model-identity DECODE null") {
		t.Fatalf("with --rehash: exit %d, findings %q", code, keys)
	}
	for _, f := range findings {
		if f.Rule == "model-identity" && (f.Severity != diag.Critical || !strings.Contains(f.Summary, "full hash changed")) {
			t.Errorf("%+v", f)
		}
	}
}
