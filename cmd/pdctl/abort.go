package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/api/zmtp"
	"github.com/spf13/cobra"
)

type abortOptions struct {
	f      *factory
	Attach *attachOptions

	// Synthetic ABORTs.
	Prefill        string
	Rank           int // -1: every rank
	Room           uint64
	RoomsFromQueue string
	Wait           time.Duration
	Listen         string

	// The mass-abort drill.
	Sessions     int
	After        time.Duration // 0: until every session's first byte, at most firstByteWait
	DrainTimeout time.Duration
	MaxTokens    int
	Check        int // new requests sent after the drain

	JSON    bool
	roomSet bool
}

// firstByteWait bounds the drill's wait for the sessions' first bytes
// without --after.
const firstByteWait = 2 * time.Second

// drainStable is how long every queue must stay empty to count as drained.
const drainStable = 100 * time.Millisecond

// prefillQueues are the queues whose rooms --rooms-from-queue aborts.
var prefillQueues = debug.PDQueuesOf(pdproto.RolePrefill)

func newCmdAbort(f *factory, runF func(context.Context, *abortOptions) error) *cobra.Command {
	opts := &abortOptions{f: f, Attach: &f.attach}
	cmd := &cobra.Command{
		Use:   "abort",
		Short: "Send synthetic ABORTs to a prefill rank, or run the mass-abort drill",
		Long: `Send a synthetic ABORT to a prefill rank's control socket, exactly as a decode
rank would, and report whether its ABORT_ACK comes back:

  pdctl abort --prefill URL --rank N --room R [--wait 2s]
  pdctl abort --prefill URL [--rank N] --rooms-from-queue NAME

The rank's control endpoint is read from the prefill server's /debug/v1/pd;
pdctl listens on a local ZeroMQ PULL socket (--listen) for the acks, whose
endpoint it puts in the ABORTs. Without --rank every rank of the server is
sent the ABORT. --rooms-from-queue aborts every room now in that queue
(bootstrap, active or inflight). Each ABORT_ACK says whether the rank had
the room when the ABORT came: RESULT is "acked" when it had, "acked, room
unknown" when it had not (nothing was aborted there) or, for a room listed
from the queue, "acked, room already ended" (another rank's ABORT may have
failed it on every rank first). Exit 0 when every ABORT was acknowledged
within --wait (and, with --room, some rank had the room), 1 otherwise; a
control loop that the debug API shows dead is named.

  pdctl abort --sessions N [--after DURATION] [--drain-timeout 10s] [--max-tokens N]

The mass-abort drill, through the router (--router): opens N streaming
completions of --max-tokens each (default: as many as the model's context
and the servers' KV pools leave after the prompt, at most 1000, read from
the servers' GET /debug/v1/state), waits --after (default: until every
session received its first byte, at most 2s), cancels them all at once,
then polls every PD server's /debug/v1/pd and reports how long each queue
took to drain, and whether new requests are served afterwards. Exit 0 when
no session was refused, every queue drained and every new request was
served, 1 otherwise.

--json prints either report as one JSON object (the exit code is the same).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			opts.roomSet = cmd.Flags().Changed("room")
			if err := opts.validate(cmd); err != nil {
				return err
			}
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			if opts.Sessions > 0 {
				return drillRun(cmd.Context(), opts)
			}
			return syntheticAbortRun(cmd.Context(), opts)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&opts.Prefill, "prefill", "", "the prefill server to send ABORTs to (its base URL)")
	fl.IntVar(&opts.Rank, "rank", -1, "only this prefill rank (default every rank)")
	fl.Uint64Var(&opts.Room, "room", 0, "the bootstrap room to abort")
	fl.StringVar(&opts.RoomsFromQueue, "rooms-from-queue", "", "abort every room in this prefill queue: "+strings.Join(prefillQueues, ", "))
	fl.DurationVar(&opts.Wait, "wait", 2*time.Second, "how long to wait for the ABORT_ACKs")
	fl.StringVar(&opts.Listen, "listen", "tcp://127.0.0.1:0", "where to receive the ABORT_ACKs (a ZeroMQ endpoint the prefill can reach)")
	fl.IntVar(&opts.Sessions, "sessions", 0, "run the mass-abort drill with this many streaming sessions")
	fl.DurationVar(&opts.After, "after", 0, "drill: cancel the sessions after this long (default: once each has its first byte, at most 2s)")
	fl.DurationVar(&opts.DrainTimeout, "drain-timeout", 10*time.Second, "drill: how long the queues may take to drain")
	fl.IntVar(&opts.MaxTokens, "max-tokens", 0, "drill: max_tokens of each session (default: what the model's context and the KV pools leave, at most 1000)")
	fl.IntVar(&opts.Check, "check", 3, "drill: new requests sent after the drain")
	fl.BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

func (o *abortOptions) validate(cmd *cobra.Command) error {
	if o.Sessions < 0 {
		return newUsageError(cmd, "--sessions must be positive")
	}
	if o.Sessions > 0 {
		if o.Prefill != "" || o.roomSet || o.RoomsFromQueue != "" {
			return newUsageError(cmd, "--sessions runs the drill through the router; it cannot be used with --prefill, --room or --rooms-from-queue")
		}
		if o.After < 0 || o.DrainTimeout <= 0 || o.MaxTokens < 0 || o.Check < 0 {
			return newUsageError(cmd, "--after, --drain-timeout, --max-tokens and --check must be positive")
		}
		return nil
	}
	if o.Prefill == "" {
		return newUsageError(cmd, "abort needs --prefill URL with --room or --rooms-from-queue, or --sessions N")
	}
	if o.roomSet == (o.RoomsFromQueue != "") {
		return newUsageError(cmd, "abort needs exactly one of --room and --rooms-from-queue")
	}
	if o.RoomsFromQueue != "" && !slices.Contains(prefillQueues, o.RoomsFromQueue) {
		return newUsageError(cmd, "unknown prefill queue %q (known: %s)", o.RoomsFromQueue, strings.Join(prefillQueues, ", "))
	}
	if o.Wait <= 0 {
		return newUsageError(cmd, "--wait must be positive")
	}
	return nil
}

// abortTarget is one ABORT: a room on one prefill rank, and what came of
// it.
type abortTarget struct {
	Room     debug.ID `json:"room"`
	Rank     int      `json:"rank"`
	Endpoint string   `json:"endpoint"`
	Result   string   `json:"result"` // acked; acked, room unknown; acked, room already ended; no ack; send failed: ...
	// Known, InFlight and AckMS are the ack's: whether the rank had the
	// room when the ABORT came, whether a write for the room was in
	// flight, and when the ack came after the first ABORT went.
	Known    bool    `json:"known"`
	InFlight bool    `json:"in_flight"`
	AckMS    float64 `json:"ack_ms"`
	// ControlLoop is the rank's control loop after the wait: alive, or
	// dead with its exit reason.
	ControlLoop string `json:"control_loop"`
	listed      bool   // the room was in the rank's queue (--rooms-from-queue)
}

// abortOutput is the JSON report of synthetic ABORTs.
type abortOutput struct {
	Aborts []*abortTarget `json:"aborts"`
}

type ackKey struct {
	room debug.ID
	rank int
}

func syntheticAbortRun(ctx context.Context, opts *abortOptions) error {
	f := opts.f
	c := client.New(opts.Prefill, opts.Attach.token(f), opts.Attach.HTTP)
	pd, err := c.PD(ctx, "")
	if err != nil {
		return err
	}
	if pd.Role != pdproto.RolePrefill {
		return fmt.Errorf("%s is a %s server; ABORTs go to a prefill server", opts.Prefill, pd.Role)
	}
	var targets []*abortTarget
	found := false
	for _, rk := range pd.Ranks {
		if opts.Rank >= 0 && rk.Rank != opts.Rank {
			continue
		}
		found = true
		if opts.RoomsFromQueue == "" {
			targets = append(targets, &abortTarget{Room: debug.ID(opts.Room), Rank: rk.Rank, Endpoint: rk.Socket.Endpoint})
			continue
		}
		for _, e := range rk.Entries {
			if e.Queue == opts.RoomsFromQueue {
				targets = append(targets, &abortTarget{Room: e.Room, Rank: rk.Rank, Endpoint: rk.Socket.Endpoint, listed: true})
			}
		}
	}
	if !found {
		return fmt.Errorf("%s has no rank %d (%s)", opts.Prefill, opts.Rank, pluralf(len(pd.Ranks), "rank", "ranks"))
	}
	if len(targets) == 0 {
		fmt.Fprintf(f.ErrOut, "no rooms in queue %s on %s\n", opts.RoomsFromQueue, opts.Prefill)
		if opts.JSON {
			return writeJSON(f.Out, abortOutput{Aborts: []*abortTarget{}})
		}
		return nil
	}

	curve, acks, err := opts.Attach.pdAuth(f)
	if err != nil {
		return err
	}
	pull, err := zmtp.ListenAuth(opts.Listen, acks)
	if err != nil {
		return err
	}
	defer pull.Close()
	start := time.Now()
	pending := map[ackKey]*abortTarget{}
	byEndpoint := map[string][]*abortTarget{}
	var endpoints []string
	for _, t := range targets {
		if byEndpoint[t.Endpoint] == nil {
			endpoints = append(endpoints, t.Endpoint)
		}
		byEndpoint[t.Endpoint] = append(byEndpoint[t.Endpoint], t)
	}
	waitCtx, cancel := context.WithTimeout(ctx, opts.Wait)
	defer cancel()
	for _, ep := range endpoints {
		sendAborts(waitCtx, curve, pull.Endpoint(), ep, byEndpoint[ep], pending)
	}
	for len(pending) > 0 {
		frames, err := pull.Recv(waitCtx)
		if err != nil {
			break
		}
		m, err := pdproto.Decode(frames)
		if err != nil {
			fmt.Fprintf(f.ErrOut, "dropped a message that is not an ABORT_ACK: %v\n", err)
			continue
		}
		ack, ok := m.(*pdproto.AbortAck)
		if !ok {
			continue
		}
		k := ackKey{debug.ID(ack.Room), int(ack.Rank)}
		if t := pending[k]; t != nil {
			t.Result, t.Known, t.InFlight, t.AckMS = resultAcked, ack.Known, ack.InFlight, millis(time.Since(start))
			if !ack.Known {
				t.Result = resultUnknown
				if t.listed {
					t.Result = resultEnded
				}
			}
			delete(pending, k)
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// The loops' liveness, read after the wait: an ABORT may have
	// killed one.
	loops := map[int]string{}
	if pd, err := c.PD(ctx, ""); err == nil {
		for _, rk := range pd.Ranks {
			loops[rk.Rank] = "alive"
			if !rk.Socket.Alive {
				loops[rk.Rank] = "dead"
				if rk.Socket.ExitReason != "" {
					loops[rk.Rank] += ": " + rk.Socket.ExitReason
				}
			}
		}
	}
	tab := newTable([]string{"ROOM", "RANK", "ENDPOINT", "RESULT", "IN FLIGHT", "ACK TIME", "CONTROL LOOP"}, "ACK TIME")
	failed := 0
	var dead []string
	known := false // with --room: some rank had it
	for _, t := range targets {
		t.ControlLoop = loops[t.Rank]
		inFlight, waited := "-", "-"
		acked := t.Result == resultAcked || t.Result == resultUnknown || t.Result == resultEnded
		if acked {
			inFlight, waited = yesNo(t.InFlight), fmtMilli(t.AckMS)
			known = known || t.Known
		} else {
			failed++
		}
		tab.add(t.Room.String(), itoa(t.Rank), t.Endpoint, t.Result, inFlight, waited, t.ControlLoop)
		if strings.HasPrefix(t.ControlLoop, "dead") && !acked {
			d := "rank " + itoa(t.Rank)
			if !slices.Contains(dead, d) {
				dead = append(dead, d)
			}
		}
	}
	if opts.JSON {
		err = writeJSON(f.Out, abortOutput{Aborts: targets})
	} else {
		err = tab.print(f)
	}
	if err != nil {
		return err
	}
	if failed == 0 {
		if opts.RoomsFromQueue == "" && !known {
			return fmt.Errorf("room %d: no rank of %s had it, nothing was aborted (each acknowledged the ABORT of a room it did not know)", opts.Room, opts.Prefill)
		}
		return nil
	}
	msg := fmt.Sprintf("%s of %d not acknowledged within %v", pluralf(failed, "ABORT", "ABORTs"), len(targets), opts.Wait)
	if len(dead) > 0 {
		msg += "; the control loop of " + strings.Join(dead, " and ") + " of " + opts.Prefill + " is dead"
	}
	return errors.New(msg)
}

// The results of an ABORT that was acknowledged: the rank had the room,
// or it did not; for a room listed in the rank's queue moments before,
// the room ended in between (often because another rank's ABORT failed
// it on every rank).
const (
	resultAcked   = "acked"
	resultUnknown = "acked, room unknown"
	resultEnded   = "acked, room already ended"
)

// authHint is err's text, with what to do when the rank's socket refused
// pdctl's credential or wants one.
func authHint(err error) string {
	switch {
	case errors.Is(err, zmtp.ErrAuthRequired):
		return err.Error() + " (give pdctl the cluster secret the servers run with, or none when they run without one: --cluster-secret-file or PD_CLUSTER_SECRET)"
	case errors.Is(err, zmtp.ErrAuthRefused):
		return err.Error() + " (the cluster secret given differs from the servers')"
	}
	return err.Error()
}

// sendAborts sends the ABORTs of targets to one prefill rank's control
// endpoint over one connection (CURVE with the cluster secret's keys,
// NULL without a secret), each asking for its ack at ackEndpoint.
func sendAborts(ctx context.Context, curve *zmtp.CurveAuth, ackEndpoint, endpoint string, targets []*abortTarget, pending map[ackKey]*abortTarget) {
	var p *zmtp.Push
	var err error
	if curve != nil {
		p, err = zmtp.DialCurve(ctx, endpoint, curve)
	} else {
		p, err = zmtp.Dial(ctx, endpoint)
	}
	if err == nil {
		defer p.Close()
	}
	for _, t := range targets {
		t.Result = "no ack"
		if err == nil {
			var frames [][]byte
			frames, err = pdproto.Encode(&pdproto.Abort{Room: uint64(t.Room), Endpoint: ackEndpoint, Rank: uint32(t.Rank), Reason: "pdctl: aborted by an operator", Asked: true})
			if err == nil {
				err = p.Send(ctx, frames)
			}
		}
		if err != nil {
			t.Result = "send failed: " + authHint(err)
			continue
		}
		pending[ackKey{t.Room, t.Rank}] = t
	}
}

// fmtDuration renders d in milliseconds with one decimal.
func fmtDuration(d time.Duration) string { return fmtMilli(millis(d)) }

// fmtMilli renders a count of milliseconds with one decimal.
func fmtMilli(ms float64) string { return fmt.Sprintf("%.1fms", ms) }

// millis is d in milliseconds, the unit of every duration in the JSON.
func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// drillQueue is one queue of one server during the drill.
type drillQueue struct {
	server, role, queue string
	peak                int
	zeroSince           time.Time // start of the current empty streak; zero while not empty
}

// drillOutput is the drill's report.
type drillOutput struct {
	Sessions         int     `json:"sessions"`
	MaxTokens        int     `json:"max_tokens"`
	Streaming        int     `json:"streaming"` // had their first byte when cancelled
	Finished         int     `json:"finished"`  // ended before the cancel
	Refused          int     `json:"refused"`
	Refusal          string  `json:"refusal,omitempty"` // the last refusal's error
	CancelledAfterMS float64 `json:"cancelled_after_ms"`
	// DrainTimeoutMS bounds the wait for the queues to drain.
	DrainTimeoutMS float64            `json:"drain_timeout_ms"`
	Queues         []drillQueueOutput `json:"queues"`
	Unreachable    map[string]string  `json:"unreachable,omitempty"`
	Check          drillCheckOutput   `json:"check"`
}

// drillQueueOutput is one queue's drain: Drained, and DrainedInMS after the
// cancel (the start of the queue's last empty streak).
type drillQueueOutput struct {
	Server      string  `json:"server"`
	Role        string  `json:"role"`
	Queue       string  `json:"queue"`
	Peak        int     `json:"peak"`
	Drained     bool    `json:"drained"`
	DrainedInMS float64 `json:"drained_in_ms"`
}

// drillCheckOutput is the new requests sent after the drain.
type drillCheckOutput struct {
	Sent   int    `json:"sent"`
	Served int    `json:"served"`
	Error  string `json:"error,omitempty"` // the last failure's
}

func drillRun(ctx context.Context, opts *abortOptions) error {
	f := opts.f
	targets, err := opts.Attach.targets(ctx, f)
	if err != nil {
		return err
	}
	router := strings.TrimRight(opts.Attach.Router, "/")
	maxTokens := opts.MaxTokens
	if maxTokens == 0 {
		if maxTokens, err = drillMaxTokens(ctx, targets); err != nil {
			return err
		}
	}
	hc := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: opts.Sessions}}
	defer hc.CloseIdleConnections()

	// Open the sessions.
	sctx, cancelSessions := context.WithCancel(ctx)
	defer cancelSessions()
	body, _ := json.Marshal(map[string]any{"prompt": drillPrompt, "max_tokens": maxTokens, "stream": true})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstBytes, refused, finished int
	var refusal string
	settled := make(chan struct{}, opts.Sessions) // a first byte or a failure
	for range opts.Sessions {
		wg.Go(func() {
			got := false
			defer func() {
				if !got {
					settled <- struct{}{}
				}
			}()
			req, err := http.NewRequestWithContext(sctx, http.MethodPost, router+"/v1/completions", bytes.NewReader(body))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := hc.Do(req)
			if err != nil {
				if sctx.Err() == nil {
					mu.Lock()
					refused++
					refusal = err.Error()
					mu.Unlock()
				}
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
				mu.Lock()
				refused++
				refusal = fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(b)))
				mu.Unlock()
				return
			}
			var one [1]byte
			if n, _ := io.ReadFull(resp.Body, one[:]); n == 1 {
				got = true
				mu.Lock()
				firstBytes++
				mu.Unlock()
				settled <- struct{}{}
			}
			if _, err := io.Copy(io.Discard, resp.Body); err == nil {
				mu.Lock()
				finished++
				mu.Unlock()
			}
		})
	}
	opened := time.Now()
	if opts.After > 0 {
		select {
		case <-time.After(opts.After):
		case <-ctx.Done():
		}
	} else {
		timeout := time.After(firstByteWait)
	wait:
		for range opts.Sessions {
			select {
			case <-settled:
			case <-timeout:
				break wait
			case <-ctx.Done():
				break wait
			}
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	cancelAt := time.Now()
	cancelSessions()
	wg.Wait()
	rep := drillOutput{Sessions: opts.Sessions, MaxTokens: maxTokens, Streaming: firstBytes, Finished: finished, Refused: refused, Refusal: refusal,
		CancelledAfterMS: millis(cancelAt.Sub(opened)), DrainTimeoutMS: millis(opts.DrainTimeout), Queues: []drillQueueOutput{}}
	fmt.Fprintf(f.ErrOut, "opened %s of max_tokens %d through %s; %d streaming, %d finished, %d refused; cancelled after %s\n",
		pluralf(opts.Sessions, "session", "sessions"), maxTokens, router, firstBytes, finished, refused, fmtDuration(cancelAt.Sub(opened)))
	if refused > 0 {
		fmt.Fprintf(f.ErrOut, "a session was refused: %s\n", refusal)
	}

	// Watch the queues drain.
	var pdc []*client.Client
	for _, t := range targets {
		if t.Err == nil && isPD(t.Role) {
			pdc = append(pdc, t.c)
		}
	}
	queues := map[string]*drillQueue{}
	var order []string
	unreachable := map[string]string{}
	deadline := cancelAt.Add(opts.DrainTimeout)
	for {
		now := time.Now()
		res := client.Each(ctx, pdc, func(ctx context.Context, c *client.Client) (debug.PDResponse, error) { return c.PD(ctx, "") })
		allZero := true
		for _, r := range res {
			if r.Err != nil {
				unreachable[r.URL] = r.Err.Error()
				allZero = false
				continue
			}
			delete(unreachable, r.URL)
			counts := map[string]int{}
			for _, rk := range r.Value.Ranks {
				for q, n := range rk.Counts {
					counts[q] += n
				}
			}
			for _, q := range debug.PDQueuesOf(r.Value.Role) {
				n := counts[q] // a queue left out is empty
				key := r.URL + " " + q
				dq := queues[key]
				if dq == nil {
					dq = &drillQueue{server: r.URL, role: r.Value.Role, queue: q}
					queues[key] = dq
					order = append(order, key)
				}
				dq.peak = max(dq.peak, n)
				if n > 0 {
					dq.zeroSince = time.Time{}
					allZero = false
				} else if dq.zeroSince.IsZero() {
					dq.zeroSince = now
				}
			}
		}
		stableSince := cancelAt
		for _, dq := range queues {
			if !dq.zeroSince.IsZero() && dq.zeroSince.After(stableSince) {
				stableSince = dq.zeroSince
			}
		}
		if allZero && now.Sub(stableSince) >= drainStable {
			break
		}
		if now.After(deadline) || ctx.Err() != nil {
			break
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	notDrained := 0
	for _, key := range order {
		dq := queues[key]
		q := drillQueueOutput{Server: dq.server, Role: dq.role, Queue: dq.queue, Peak: dq.peak, Drained: !dq.zeroSince.IsZero()}
		if q.Drained {
			q.DrainedInMS = millis(max(0, dq.zeroSince.Sub(cancelAt)))
		} else {
			notDrained++
		}
		rep.Queues = append(rep.Queues, q)
	}
	if len(unreachable) > 0 {
		rep.Unreachable = unreachable
	}

	// New requests after the drain.
	served, lastErr := drillCheck(ctx, hc, router, opts.Check)
	rep.Check = drillCheckOutput{Sent: opts.Check, Served: served, Error: lastErr}
	if opts.JSON {
		err = writeJSON(f.Out, rep)
	} else {
		err = printTables(f, drillTables(rep)...)
	}
	if err != nil {
		return err
	}
	var problems []string
	if refused > 0 {
		problems = append(problems, fmt.Sprintf("%d of %d sessions refused (%s)", refused, opts.Sessions, refusal))
	}
	if notDrained > 0 {
		problems = append(problems, pluralf(notDrained, "queue", "queues")+" not drained within "+opts.DrainTimeout.String())
	}
	if len(unreachable) > 0 {
		problems = append(problems, pluralf(len(unreachable), "server", "servers")+" unreachable")
	}
	if served < opts.Check {
		problems = append(problems, fmt.Sprintf("%d of %d new requests served", served, opts.Check))
	}
	if len(problems) > 0 {
		return errors.New("the drill failed: " + strings.Join(problems, ", "))
	}
	return nil
}

// drillPrompt is the prompt of the drill's sessions, and drillPromptRoom
// the context it may take at most: a few tokens in any tokenizer.
const (
	drillPrompt     = "drill"
	drillPromptRoom = 32
	drillMaxDefault = 1000 // the most max_tokens the drill asks by default
)

// drillMaxTokens is the drill's default max_tokens: what the servers
// accept for one request after the prompt, at most drillMaxDefault. A
// request may take no more than the model's context nor more than a
// rank's KV pool; both are read from every server's GET /debug/v1/state,
// and the smallest wins.
func drillMaxTokens(ctx context.Context, targets []*target) (int, error) {
	limit := 0
	var why []string
	for _, t := range targets {
		if t.Err != nil {
			why = append(why, t.URL+": "+t.Err.Error())
			continue
		}
		st, err := t.c.State(ctx)
		if err != nil {
			why = append(why, err.Error())
			continue
		}
		if st.ContextTokens <= 0 {
			why = append(why, t.URL+" publishes no context length")
			continue
		}
		n := st.ContextTokens
		if pool := st.Settings.KVPages * st.Settings.PageSize; pool > 0 {
			n = min(n, pool)
		}
		if limit == 0 || n < limit {
			limit = n
		}
	}
	switch {
	case limit == 0:
		return 0, fmt.Errorf("the model's context length could not be read (%s); give --max-tokens", strings.Join(why, "; "))
	case limit <= 2*drillPromptRoom:
		return max(1, limit/2), nil
	}
	return min(drillMaxDefault, limit-drillPromptRoom), nil
}

// drillTables is the drill's human report: the queues' drain, then the
// new requests.
func drillTables(rep drillOutput) []*table {
	tab := newTable([]string{"SERVER", "ROLE", "QUEUE", "PEAK", "RESULT", "DRAINED IN"}, "PEAK", "DRAINED IN")
	for _, q := range rep.Queues {
		result, in := "drained", fmtMilli(q.DrainedInMS)
		if !q.Drained {
			result, in = "not drained within "+fmtMS(rep.DrainTimeoutMS), ""
		}
		tab.add(q.Server, q.Role, q.Queue, itoa(q.Peak), result, in)
	}
	for url, err := range sortedMap(rep.Unreachable) {
		tab.add(url, "", "", "", "unreachable: "+err, "")
	}
	check := newTable([]string{"NEW REQUESTS", "SERVED", "ERROR"})
	check.add(itoa(rep.Check.Sent), itoa(rep.Check.Served), rep.Check.Error)
	return []*table{tab, check}
}

// drillCheck sends n small completions through the router at once and
// counts those answered 200.
func drillCheck(ctx context.Context, hc *http.Client, router string, n int) (int, string) {
	body, _ := json.Marshal(map[string]any{"prompt": "drill check", "max_tokens": 4, "temperature": 0})
	var mu sync.Mutex
	var wg sync.WaitGroup
	served, lastErr := 0, ""
	for range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, router+"/v1/completions", bytes.NewReader(body))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := hc.Do(req)
			msg := ""
			if err != nil {
				msg = err.Error()
			} else {
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					msg = fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(b)))
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if msg == "" {
				served++
			} else {
				lastErr = msg
			}
		})
	}
	wg.Wait()
	return served, lastErr
}
