package sched

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/tracetest"
)

func TestTraces(t *testing.T) {
	tracetest.Run(t, "testdata/*.txt", func(t *testing.T) func(string) string {
		h := &harness{}
		return func(cmd string) string { return h.run(t, cmd) }
	})
}

// harness runs trace commands against one scheduler and prints results.
type harness struct {
	s *Scheduler
}

type args map[string]string

func parseArgs(fields []string) (args, []string) {
	a := args{}
	var rest []string
	for _, f := range fields {
		if k, v, ok := strings.Cut(f, "="); ok && !strings.Contains(k, ":") {
			a[k] = v
		} else {
			rest = append(rest, f)
		}
	}
	return a, rest
}

func (a args) int(t *testing.T, k string, def int) int {
	v, ok := a[k]
	if !ok {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", k, v, err)
	}
	return n
}

// dur reads a duration: a Go duration ("1.5s") or whole seconds ("400").
func (a args) dur(t *testing.T, k string) time.Duration {
	v, ok := a[k]
	if !ok {
		return 0
	}
	if n, err := strconv.Atoi(v); err == nil {
		return time.Duration(n) * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", k, v, err)
	}
	return d
}

func (h *harness) run(t *testing.T, line string) string {
	t.Helper()
	fields := strings.Fields(line)
	a, rest := parseArgs(fields[1:])
	var b strings.Builder
	if fields[0] != "config" && h.s == nil {
		t.Fatalf("%q before config", line)
	}
	voided := 0 // items voided before this command
	if h.s != nil {
		voided = len(h.s.voided)
	}
	switch fields[0] {
	case "config":
		cfg := Config{
			MaxRunning:     a.int(t, "max-running", 4),
			MaxBatchTokens: a.int(t, "batch-tokens", 64),
			PrefillChunk:   a.int(t, "chunk", 16),
			PageSize:       a.int(t, "page-size", 4),
			TotalPages:     a.int(t, "pages", 64),
			Overlap:        a["overlap"] == "true",
			WaitingTimeout: a.dur(t, "waiting-timeout"),
			PrefillTimeout: a.dur(t, "prefill-timeout"),
			RequestTimeout: a.dur(t, "request-timeout"),
		}
		s, err := New(cfg)
		if err != nil {
			return "error: " + err.Error() + "\n"
		}
		h.s = s
		return "ok\n"
	case "add":
		err := h.s.Add(Request{ID: uint64(a.int(t, "id", 0)), PromptLen: a.int(t, "prompt", 1), MaxTokens: a.int(t, "max", 1), Cached: a.int(t, "cached", 0), Loaded: a.int(t, "loaded", 0), Transferred: a.int(t, "transferred", 0)}, a.dur(t, "t"))
		if err != nil {
			fmt.Fprintf(&b, "error: %v\n", err)
		}
	case "abort":
		id := uint64(a.int(t, "id", 0))
		already := h.s.reqs[id] != nil && h.s.reqs[id].state == Aborting && h.s.reqs[id].cut != ReasonLength
		f, err := h.s.Abort(id, a.dur(t, "t"))
		switch {
		case err != nil:
			fmt.Fprintf(&b, "error: %v\n", err)
		case already:
			b.WriteString("already aborting: nothing to do\n")
		case len(f) == 0:
			b.WriteString("in the step in flight: finishes at step end\n")
		}
		writeFinishes(&b, f)
	case "uncache":
		if err := h.s.Uncache(uint64(a.int(t, "id", 0)), a.int(t, "cached", 0), a.dur(t, "t")); err != nil {
			fmt.Fprintf(&b, "error: %v\n", err)
		}
	case "tick":
		writeFinishes(&b, h.s.Tick(a.dur(t, "t")))
	case "schedule":
		p, err := h.s.Schedule(a.dur(t, "t"), a.int(t, "free", h.s.cfg.TotalPages-h.s.held))
		if err != nil {
			fmt.Fprintf(&b, "error: %v\n", err)
		}
		writePlan(&b, p)
	case "done":
		outs := h.outcomes(t, rest)
		f, err := h.s.StepDone(a.dur(t, "t"), outs)
		if err != nil {
			fmt.Fprintf(&b, "error: %v\n", err)
		}
		writeFinishes(&b, f)
	case "snapshot":
		writeSnapshot(&b, h.s.Snapshot())
		return b.String()
	case "reserve":
		fmt.Fprintf(&b, "reserve=%d\n", h.s.Reserve(a.int(t, "growth", 0)))
		return b.String()
	default:
		t.Fatalf("unknown command %q", line)
	}
	if v := h.s.Voided(); fields[0] != "schedule" && len(v) > voided {
		fmt.Fprintf(&b, "voided %v\n", v[voided:])
	}
	if err := h.s.Check(); err != nil {
		fmt.Fprintf(&b, "CHECK FAILED: %v\n", err)
	}
	writeState(&b, h.s)
	return b.String()
}

// outcomes builds the step's outcomes: by default one token for every item
// that wants logits; "ID:emit=N", "ID:stop", "ID:skip" (no outcome) and
// "ID:extra" (an outcome for an id not in the step) override.
func (h *harness) outcomes(t *testing.T, specs []string) []Outcome {
	over := map[uint64][]string{}
	var order []uint64
	for _, sp := range specs {
		id, opts, ok := strings.Cut(sp, ":")
		n, err := strconv.ParseUint(id, 10, 64)
		if !ok || err != nil {
			t.Fatalf("bad outcome %q", sp)
		}
		over[n] = strings.Split(opts, ",")
		order = append(order, n)
	}
	var outs []Outcome
	for _, it := range h.s.step {
		o := Outcome{ID: it.ID}
		if it.WantLogits {
			o.Emitted = 1
		}
		skip := false
		for _, opt := range over[it.ID] {
			switch {
			case opt == "stop":
				o.Stop = true
			case opt == "skip":
				skip = true
			case strings.HasPrefix(opt, "emit="):
				o.Emitted, _ = strconv.Atoi(strings.TrimPrefix(opt, "emit="))
			default:
				t.Fatalf("bad outcome option %q", opt)
			}
		}
		if !skip {
			outs = append(outs, o)
		}
	}
	for _, id := range order {
		if len(over[id]) == 1 && over[id][0] == "extra" {
			outs = append(outs, Outcome{ID: id, Emitted: 1})
		}
	}
	return outs
}

func writePlan(b *strings.Builder, p Plan) {
	writeFinishes(b, p.Finished)
	for _, r := range p.Retract {
		fmt.Fprintf(b, "retract %d generated=%d free-pages=%d\n", r.ID, r.Generated, r.Pages)
	}
	for _, it := range p.Run {
		kind := "prefill"
		if it.Tokens == 1 && it.WantLogits && it.Start > 0 {
			kind = "decode"
		}
		fmt.Fprintf(b, "run %d %s [%d,%d) logits=%t pages=%d", it.ID, kind, it.Start, it.Start+it.Tokens, it.WantLogits, it.Pages)
		if it.Cached > 0 {
			fmt.Fprintf(b, " cached=%d", it.Cached)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(b, "pages-needed=%d\n", p.PagesNeeded)
}

func writeFinishes(b *strings.Builder, fs []Finish) {
	for _, f := range fs {
		fmt.Fprintf(b, "finish %d %v generated=%d", f.ID, f.Reason, f.Generated)
		if f.Release {
			fmt.Fprintf(b, " release-pages=%d", f.Pages)
		}
		b.WriteString("\n")
	}
}

func writeState(b *strings.Builder, s *Scheduler) {
	q := func(name string, rs []*request) {
		fmt.Fprintf(b, " %s=[", name)
		for i, r := range rs {
			if i > 0 {
				b.WriteString(" ")
			}
			fmt.Fprintf(b, "%d", r.id)
		}
		b.WriteString("]")
	}
	b.WriteString("state:")
	q("waiting", s.waiting)
	q("prefilling", s.prefilling)
	q("running", s.running)
	if len(s.aborting) > 0 {
		q("aborting", s.aborting)
	}
	fmt.Fprintf(b, " held=%d", s.held)
	if s.step != nil {
		b.WriteString(" step-in-flight")
	}
	if s.ahead != nil {
		fmt.Fprintf(b, " step-ahead=%d", len(s.ahead))
	}
	b.WriteString("\n")
}

func writeSnapshot(b *strings.Builder, sn Snapshot) {
	fmt.Fprintf(b, "now=%v held=%d/%d step-in-flight=%t", sn.Now, sn.HeldPages, sn.TotalPages, sn.StepInFlight)
	if sn.StepAhead {
		b.WriteString(" step-ahead=true")
	}
	b.WriteString("\n")
	for _, q := range [][]ReqInfo{sn.Waiting, sn.Prefilling, sn.Running, sn.Aborting} {
		for _, r := range q {
			fmt.Fprintf(b, "%d %v age=%v in-state=%v prompt=%d max=%d generated=%d fed=%d in-flight=%d pages=%d retractions=%d\n",
				r.ID, r.State, r.Age, r.InState, r.PromptLen, r.MaxTokens, r.Generated, r.Fed, r.InFlight, r.Pages, r.Retractions)
		}
	}
}
