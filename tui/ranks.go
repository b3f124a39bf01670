package tui

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
)

// The ranks panel's columns, in the order a narrowing screen drops them
// (the highest first); 0 never goes. What names a stalled rank (the
// mark, RANK, STEP, Δ, WAITS IN, FOR) never goes.
const (
	dropKV = 10 - iota
	dropPD
	dropFwdSeq
	dropCtrlSeq
	dropAge
	dropLoop
	dropHistory // narrows first, down to its header, then goes
	dropRate
	dropPhase
)

// loopOf is the rank loop a server's ranks run, as their step records say
// ("lockstep"); "" when a server publishes none (an older one): the view
// does not guess.
func loopOf(sv diag.ServerSample) string {
	if sv.Steps == nil {
		return ""
	}
	for _, r := range sv.Steps.Ranks {
		if r.Loop != "" {
			return r.Loop
		}
	}
	return ""
}

// rankPanel is one server's ranks as the frame shows them: a title line
// and the ranks' table fitted to the width.
type rankPanel struct {
	title string
	table string
}

// rankPanels renders a panel for every server of the last sample that
// answered its steps: per rank a mark ("!": the rank is stalled or
// diverged), its rank, loop, phase, step, Δ to its group's highest step,
// the collective it waits in (communicator, seq, op) and for how long, its
// step rate now and over the last samples (a sparkline scaled to the
// group's highest rate), the age of its last step, its seqs on the two
// communicators, its PD queues and KV pages. findings are the rules'
// over the window: a rank a rank-divergence finding names is marked.
func (o FrameOptions) rankPanels(last diag.Sample, hist *History, findings []diag.Finding) []rankPanel {
	var titles []string
	var tables [][]column
	for _, sv := range last.Servers {
		if !sv.Reachable || sv.Steps == nil || len(sv.Steps.Ranks) == 0 {
			continue
		}
		title, cols := o.rankPanel(sv, hist, findings)
		titles, tables = append(titles, title), append(tables, cols)
	}
	out := make([]rankPanel, len(titles))
	for i, t := range o.fitAll(tables, o.Width, hist.Len()) {
		out[i] = rankPanel{title: titles[i], table: t}
	}
	return out
}

// rankState is what the panel knows of one rank.
type rankState struct {
	debug.Step
	delta   int64
	waits   []string      // the calls it waits in: "control seq 41 Broadcast"
	waited  time.Duration // the longest of them so far
	missing string        // in no collective while its peers wait in this call past the limit
	flagged bool
}

// rankPanel is the title and the columns of one server's ranks panel.
func (o FrameOptions) rankPanel(sv diag.ServerSample, hist *History, findings []diag.Finding) (string, []column) {
	limit := o.Config.LimitsOf(&sv).CollectiveWait
	ranks := slices.Clone(sv.Steps.Ranks)
	slices.SortFunc(ranks, func(a, b debug.Step) int { return a.Rank - b.Rank })
	var top uint64
	for _, r := range ranks {
		top = max(top, r.Step)
	}
	named := map[int]bool{}
	for _, f := range findings {
		if f.Rule == "rank-divergence" && f.Server == sv.URL && f.Rank != nil {
			named[*f.Rank] = true
		}
	}
	// The calls some rank has waited in past the limit: a peer not in
	// them holds the group.
	type call struct {
		comm string
		seq  uint64
		op   string
	}
	var stalled []call
	in := map[int]map[call]bool{}
	states := make([]rankState, len(ranks))
	for i, r := range ranks {
		st := rankState{Step: r, delta: -int64(top - r.Step)}
		in[r.Rank] = map[call]bool{}
		if sv.Collectives != nil {
			for _, cm := range sv.Collectives.Comms {
				cr := cm.Rank(r.Rank)
				if cr == nil || cr.Waiting == nil {
					continue
				}
				w := cr.Waiting
				c := call{cm.Name, w.Seq, w.Op}
				in[r.Rank][c] = true
				st.waits = append(st.waits, fmt.Sprintf("%s seq %d %s", cm.Name, w.Seq, w.Op))
				d := time.Duration(w.DurationMS * float64(time.Millisecond))
				st.waited = max(st.waited, d)
				if d > limit && !slices.Contains(stalled, c) {
					stalled = append(stalled, c)
				}
			}
		}
		states[i] = st
	}
	diverged := false
	for i := range states {
		st := &states[i]
		for _, c := range stalled {
			// A rank in no collective while a peer waits past the limit:
			// the one that holds the group (ranks each waiting in another
			// call say so in WAITS IN).
			if len(st.waits) == 0 && !in[st.Rank][c] && st.missing == "" {
				st.missing = fmt.Sprintf("not in %s seq %d", c.comm, c.seq)
			}
		}
		st.flagged = named[st.Rank] || st.delta < -1 || st.waited > limit || st.missing != ""
		diverged = diverged || st.flagged
	}

	// The title: the server, its role and TP size, and the verdict.
	tp := sv.TPSize
	if tp == 0 {
		tp = len(ranks)
	}
	title := o.style(styleTitle, fmt.Sprintf("%s (%s, TP %d)", sv.URL, sv.Role, tp))
	if diverged {
		title += " " + o.mark(diag.Critical, "DIVERGED: "+divergedSummary(states))
	} else {
		title += " in step"
	}

	var topRate float64
	for _, st := range states {
		for _, r := range hist.Rates(sv.URL, st.Rank) {
			topRate = max(topRate, r)
		}
	}
	col := func(header string, drop int, f func(st rankState) cell) column {
		c := column{header: header, drop: drop}
		for _, st := range states {
			c.cells = append(c.cells, f(st))
		}
		return c
	}
	crit := func(text string, on bool) cell {
		c := plain(text)
		if on {
			c.mark = diag.Critical
		}
		return c
	}
	loop := loopOf(sv)
	if loop == "" {
		loop = "-"
	}
	cols := []column{
		col("", 0, func(st rankState) cell { return crit(map[bool]string{true: "!", false: " "}[st.flagged], st.flagged) }),
		col("RANK", 0, func(st rankState) cell { return crit(fmt.Sprint(st.Rank), st.flagged) }),
		col("LOOP", dropLoop, func(rankState) cell { return plain(loop) }),
		col("PHASE", dropPhase, func(st rankState) cell { return plain(st.Phase) }),
		col("STEP", 0, func(st rankState) cell { return plain(fmt.Sprint(st.Step.Step)) }),
		col("Δ", 0, func(st rankState) cell { return crit(fmt.Sprint(st.delta), st.delta < -1) }),
		col("WAITS IN", 0, func(st rankState) cell {
			switch {
			case len(st.waits) > 0:
				return crit(strings.Join(st.waits, ", "), st.waited > limit)
			case st.missing != "":
				return crit(st.missing, true)
			}
			return plain("-")
		}),
		col("FOR", 0, func(st rankState) cell {
			if len(st.waits) == 0 {
				return plain("-")
			}
			return crit(fmtAge(st.waited), st.waited > limit)
		}),
		col("STEPS/S", dropRate, func(st rankState) cell {
			rs := hist.Rates(sv.URL, st.Rank)
			if len(rs) == 0 {
				return plain("-")
			}
			return plain(fmtRate(rs[len(rs)-1]))
		}),
		{drop: dropHistory, sparkHeader: func(w int) string { return fmt.Sprintf("LAST %d", w) }, spark: func(w int) []cell {
			var cells []cell
			for _, st := range states {
				cells = append(cells, plain(sparkline(hist.Rates(sv.URL, st.Rank), w, topRate)))
			}
			return cells
		}},
		col("AGE", dropAge, func(st rankState) cell {
			if st.End.IsZero() {
				return plain("-")
			}
			return plain(fmtAge(o.Now.Sub(st.End)))
		}),
		col("CTRL SEQ", dropCtrlSeq, func(st rankState) cell { return plain(fmt.Sprint(st.ControlSeq)) }),
		col("FWD SEQ", dropFwdSeq, func(st rankState) cell { return plain(fmt.Sprint(st.ForwardSeq)) }),
		col("PD QUEUES", dropPD, func(st rankState) cell { return plain(pdCell(sv, st.Rank)) }),
		col("KV USED/CACHED/TOTAL", dropKV, func(st rankState) cell { return plain(kvCell(sv, st.Rank)) }),
	}
	return title, cols
}

// divergedSummary names the ranks that parted, the one that holds the
// group first: a rank in no collective while its peers wait, a rank behind
// its group, then the ranks waiting too long (the call is in WAITS IN).
func divergedSummary(states []rankState) string {
	var held, behind, waiting []string
	for _, st := range states {
		switch {
		case !st.flagged:
		case st.missing != "":
			held = append(held, fmt.Sprintf("rank %d %s", st.Rank, st.missing))
		case st.delta < -1:
			behind = append(behind, fmt.Sprintf("rank %d %d steps behind", st.Rank, -st.delta))
		case len(st.waits) > 0:
			waiting = append(waiting, fmt.Sprintf("rank %d waits %s", st.Rank, fmtAge(st.waited)))
		default:
			waiting = append(waiting, fmt.Sprintf("rank %d", st.Rank))
		}
	}
	return strings.Join(slices.Concat(held, behind, waiting), ", ")
}

// fmtRate writes a step rate: 12.5, 0, 140.
func fmtRate(r float64) string {
	if r >= 100 {
		return fmt.Sprintf("%.0f", r)
	}
	return strings.TrimSuffix(fmt.Sprintf("%.1f", r), ".0")
}
