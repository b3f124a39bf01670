package tui

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"charm.land/lipgloss/v2"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
)

// FrameOptions says what a frame shows and how.
type FrameOptions struct {
	Source   string        // what is watched: the router's URL, or "N servers"
	Interval time.Duration // between two samples, shown in the header
	Paused   bool
	Err      error // the last sampling error, if any
	// Styled colours the frame (a terminal); plain frames are for pipes
	// and tests.
	Styled bool
	// Width is the screen's width in cells: the tables drop their least
	// needed columns to fit it (never those that name a stalled rank) and
	// every line is cut to it. 0 leaves them whole.
	Width int
	// Height is the screen's height in lines for the frame: past it the
	// findings are cut (the first kept, with how many more), then the
	// servers' table goes, then the blank lines. 0: no limit.
	Height int
	// History is each rank's step rate over the last samples (the
	// sparkline); nil: built from window.
	History *History
	Config  diag.Config
	Now     time.Time
}

// The styles of a styled frame.
var (
	styleTitle    = lipgloss.NewStyle().Bold(true)
	styleHeader   = lipgloss.NewStyle().Bold(true).Underline(true)
	styleCritical = lipgloss.NewStyle().Foreground(lipgloss.Color("9")).Bold(true)
	styleWarning  = lipgloss.NewStyle().Foreground(lipgloss.Color("11"))
	styleDim      = lipgloss.NewStyle().Faint(true)
)

// cell is one table cell and how it is marked: a critical cell is red, a
// warning one yellow.
type cell struct {
	text string
	mark diag.Severity // 0: none
}

func plain(s string) cell { return cell{text: s} }

// The servers' table's columns in the order a narrow screen drops them
// (the highest first): what says a server is sick (its state, failures,
// the fault switches on) stays.
var serverDrops = map[string]int{"ABORT": 8, "PREFILL": 7, "WAIT": 6, "RUN": 5, "HICACHE": 4, "INDEX-K": 3}

// Frame renders the cluster as the last of window shows it: the servers;
// per server a ranks panel, one line per rank with its loop, phase, step,
// Δ to its group, the collective it waits in and for how long, its step
// rate over the last samples (a sparkline), the age of its last step, its
// seq on each communicator, its PD queues and KV, a stalled or diverged
// rank marked "!" and named in the panel's title; then the findings of the
// diag rules over the whole window. window holds the samples of the last
// few seconds, oldest first.
func Frame(window []Sample, o FrameOptions) string {
	title := "pdctl top"
	if o.Source != "" {
		title += " · " + o.Source
	}
	if len(window) > 0 {
		last := window[len(window)-1]
		title += fmt.Sprintf(" · sampled %s", last.Taken.Format("15:04:05"))
		if o.Interval > 0 {
			title += fmt.Sprintf(" every %v", o.Interval)
		}
	}
	if o.Paused {
		title += " · PAUSED"
	}
	head := []string{o.style(styleTitle, title)}
	if o.Err != nil {
		head = append(head, o.style(styleCritical, "sampling failed: "+o.Err.Error()))
	}
	if len(window) == 0 {
		return o.cut(strings.Join(append(head, "waiting for the first sample…"), "\n") + "\n")
	}
	last := window[len(window)-1]
	hist := o.History
	if hist == nil {
		hist = historyOf(window)
	}
	findings := diag.RunRules(diag.RulesWith(o.Config), diag.Window{Samples: diagSamples(window)})
	servers := lines(o.fit(columns(serverRows(window), serverDrops), o.Width, 0))
	var panels [][]string
	for _, p := range o.rankPanels(last.Sample, hist, findings) {
		panels = append(panels, append([]string{p.title}, lines(p.table)...))
	}
	span := window[len(window)-1].Taken.Sub(window[0].Taken).Round(100 * time.Millisecond)
	found := []string{o.style(styleHeader, fmt.Sprintf("FINDINGS (diag rules over %d samples, %v)", len(window), span))}
	var shown []string
	if len(findings) == 0 {
		shown = append(shown, "healthy")
	}
	for _, f := range findings {
		shown = append(shown, o.mark(f.Severity, fmt.Sprintf("%s %s %s: %s", f.Severity, f.Rule, f.Where(), f.Summary)))
	}

	// Fit the height: cut the findings (keeping the first), then the
	// servers' table, then the blank lines.
	blanks := true
	height := func() int {
		n := len(head) + len(found) + len(shown) + len(servers)
		for _, p := range panels {
			n += len(p)
		}
		if blanks {
			n += len(panels) + 1
			if len(servers) > 0 {
				n++
			}
		}
		return n
	}
	if o.Height > 0 && height() > o.Height {
		if over := height() - o.Height; len(shown) > 1 {
			keep := max(1, len(shown)-over-1)
			if keep < len(shown) {
				more := len(shown) - keep
				shown = append(shown[:keep:keep], fmt.Sprintf("… %d more (pdctl diagnose)", more))
			}
		}
		if height() > o.Height {
			servers = nil
		}
		if height() > o.Height {
			blanks = false
		}
	}
	out := head
	sep := func() {
		if blanks {
			out = append(out, "")
		}
	}
	if len(servers) > 0 {
		sep()
		out = append(out, servers...)
	}
	for _, p := range panels {
		sep()
		out = append(out, p...)
	}
	sep()
	out = append(out, found...)
	out = append(out, shown...)
	if o.Height > 0 && len(out) > o.Height {
		out = out[:o.Height]
	}
	return o.cut(strings.Join(out, "\n") + "\n")
}

// Rows returns the servers' and the ranks' tables of s as Frame shows
// them, each with its header row first, for output that is not a terminal.
func Rows(s Sample, cfg diag.Config, now time.Time) (servers, ranks [][]string) {
	return texts(serverRows([]Sample{s})), texts(rankRows(s.Sample, cfg, now))
}

func texts(rows [][]cell) [][]string {
	out := make([][]string, len(rows))
	for i, r := range rows {
		out[i] = make([]string, len(r))
		for j, c := range r {
			out[i][j] = c.text
		}
	}
	return out
}

// serverRows is the servers' table of the last sample of window: the
// router first when it was sampled, then every server with its role, TP
// size, reachability, the request queues, the requests failed, its index-K
// precision and host tier, and a detail: the fault switches that are on, or
// why the server could not be read. FAILED counts the requests failed
// since the process started as diag's requests-failing counts them (a PD
// server's failures less the rooms its decode aborted; the router's failed
// outcomes), with "(+N)", marked, when N more failed since the first
// sample of window.
func serverRows(window []Sample) [][]cell {
	rows := [][]cell{{plain("SERVER"), plain("ROLE"), plain("TP"), plain("STATE"), plain("WAIT"), plain("PREFILL"), plain("RUN"), plain("ABORT"),
		plain("FAILED"), plain("INDEX-K"), plain("HICACHE"), plain("DETAIL")}}
	first, s := window[0], window[len(window)-1]
	if r := s.Router; r != nil {
		row := []cell{plain(r.URL), plain("router"), plain("-")}
		if !r.Reachable {
			rows = append(rows, append(row, cell{text: "unreachable", mark: diag.Critical}, plain("-"), plain("-"), plain("-"), plain("-"),
				plain("-"), plain("-"), plain("-"), cell{text: r.Error, mark: diag.Critical}))
		} else {
			var from *uint64
			if f := first.Router; f != nil && f.Reachable && len(window) > 1 {
				n := diag.RouterFailures(f.Outcomes)
				from = &n
			}
			rows = append(rows, append(row, plain("up"), plain("-"), plain("-"), plain("-"), plain("-"),
				failedCell(from, diag.RouterFailures(r.Outcomes)), plain("-"), plain("-"), plain("-")))
		}
	}
	for _, sv := range s.Servers {
		row := []cell{plain(sv.URL), plain(sv.Role), plain(fmt.Sprint(sv.TPSize))}
		if !sv.Reachable {
			rows = append(rows, append(row, cell{text: "unreachable", mark: diag.Critical}, plain("-"), plain("-"), plain("-"), plain("-"),
				plain("-"), plain("-"), plain("-"), cell{text: sv.Error, mark: diag.Critical}))
			continue
		}
		row = append(row, plain("up"))
		for _, q := range []string{debug.QueueWaiting, debug.QueuePrefilling, debug.QueueRunning, debug.QueueAborting} {
			n := 0
			if sv.Requests != nil {
				n = sv.Requests.Counts[q]
			}
			row = append(row, plain(fmt.Sprint(n)))
		}
		failed := plain("-")
		if sv.PD != nil {
			var from *uint64
			for _, smp := range window[:len(window)-1] {
				if f := smp.Server(sv.URL); f != nil && f.Reachable && f.PD != nil {
					n := diag.ServerFailures(f.PD)
					from = &n
					break
				}
			}
			failed = failedCell(from, diag.ServerFailures(sv.PD))
		}
		row = append(row, failed, plain(indexKCell(sv.Settings)), plain(hicacheCell(s.HiCache[sv.URL])))
		var on []string
		if sv.Faults != nil {
			for _, f := range sv.Faults.Faults {
				if f.On {
					on = append(on, f.Name)
				}
			}
		}
		faults := cell{text: "-"}
		if len(on) > 0 {
			faults = cell{text: "faults on: " + strings.Join(on, ","), mark: diag.Warning}
		}
		rows = append(rows, append(row, faults))
	}
	return rows
}

// indexKCell is a server's index-K precision as its settings say: "fp8",
// "bf16", "fp8 (switching to bf16)" while a live switch drains, "n/a" for
// a model without a sparse indexer, "-" when not known.
func indexKCell(st *debug.Settings) string {
	switch {
	case st == nil || st.IndexK == "":
		return "-"
	case !st.Indexer:
		return "n/a"
	case st.IndexKSwitch != "" && st.IndexKSwitch != st.IndexK:
		return st.IndexK + " (switching to " + st.IndexKSwitch + ")"
	}
	return st.IndexK
}

// hicacheCell sums up a server's host tier over its ranks: "off", or "on"
// with the host tokens used/total of all ("on 1.2k/8.2k"), and how many
// ranks are on when not all; "n/a" without a prefix cache, "-" when not
// known.
func hicacheCell(h *debug.HiCacheResponse) string {
	switch {
	case h == nil:
		return "-"
	case !h.PrefixCache:
		return "n/a"
	}
	on, used, total := 0, 0, 0
	for _, r := range h.Ranks {
		if r.On {
			on++
			used, total = used+r.HostTokensUsed, total+r.HostTokens
		}
	}
	if on == 0 {
		return "off"
	}
	out := "on " + fmtCount(used) + "/" + fmtCount(total)
	if on < len(h.Ranks) {
		out += fmt.Sprintf(" (%d of %d ranks)", on, len(h.Ranks))
	}
	return out
}

// fmtCount writes a count shortly: 950, 1.2k, 8k, 3.4M.
func fmtCount(n int) string {
	short := func(v float64, unit string) string {
		return strings.TrimSuffix(fmt.Sprintf("%.1f", v), ".0") + unit
	}
	switch {
	case n < 1000:
		return fmt.Sprint(n)
	case n < 999_950:
		return short(float64(n)/1e3, "k")
	case n < 999_950_000:
		return short(float64(n)/1e6, "M")
	}
	return short(float64(n)/1e9, "G")
}

// failedCell is a count of failures, with "(+N)", marked critical, when it
// grew by N since from (nil: no earlier count). A count lower than from
// (the process restarted) grew by itself.
func failedCell(from *uint64, n uint64) cell {
	c := plain(fmt.Sprint(n))
	if from == nil {
		return c
	}
	grew := n - *from
	if n < *from {
		grew = n
	}
	if grew > 0 {
		c.text += fmt.Sprintf(" (+%d)", grew)
		c.mark = diag.Critical
	}
	return c
}

// rankRows is the ranks' table. Δ is the rank's step less the highest step
// of its server (-1 is a rank caught mid-iteration; lower is divergence);
// CTRL SEQ and FWD SEQ are the seqs of its last calls on the control and
// the forward communicator when its last step ended; COLLECTIVE is the
// call the rank waits in, named with its communicator ("control seq 41
// AllReduceMin 2.1s"), marked once it waits longer than the rules'
// threshold for its server (diag.Config.LimitsOf: at least twice the
// server's loop heartbeat).
func rankRows(s diag.Sample, cfg diag.Config, now time.Time) [][]cell {
	rows := [][]cell{{plain("SERVER"), plain("RANK"), plain("STEP"), plain("Δ"), plain("PHASE"), plain("AGE"), plain("CTRL SEQ"),
		plain("FWD SEQ"), plain("COLLECTIVE"), plain("PD QUEUES"), plain("KV USED/CACHED/TOTAL")}}
	for _, sv := range s.Servers {
		if !sv.Reachable || sv.Steps == nil {
			continue
		}
		var top uint64
		for _, r := range sv.Steps.Ranks {
			top = max(top, r.Step)
		}
		ranks := slices.Clone(sv.Steps.Ranks)
		slices.SortFunc(ranks, func(a, b debug.Step) int { return a.Rank - b.Rank })
		for _, r := range ranks {
			delta := -int64(top - r.Step)
			dc := plain(fmt.Sprint(delta))
			if delta < -1 {
				dc.mark = diag.Critical
			}
			age := "-"
			if !r.End.IsZero() {
				age = fmtAge(now.Sub(r.End))
			}
			rows = append(rows, []cell{plain(sv.URL), plain(fmt.Sprint(r.Rank)), plain(fmt.Sprint(r.Step)), dc, plain(r.Phase),
				plain(age), plain(fmt.Sprint(r.ControlSeq)), plain(fmt.Sprint(r.ForwardSeq)), collectiveCell(sv.Collectives, r.Rank, cfg.LimitsOf(&sv).CollectiveWait),
				plain(pdCell(sv, r.Rank)), plain(kvCell(sv, r.Rank))})
		}
	}
	return rows
}

// collectiveCell names the call rank waits in on each communicator (one
// at most each, both joined by ", ") and for how long, marked past wait.
func collectiveCell(c *debug.CollectivesResponse, rank int, wait time.Duration) cell {
	if c == nil {
		return plain("?")
	}
	var out cell
	for _, cm := range c.Comms {
		r := cm.Rank(rank)
		if r == nil || r.Waiting == nil {
			continue
		}
		w := r.Waiting
		d := time.Duration(w.DurationMS * float64(time.Millisecond))
		if out.text != "" {
			out.text += ", "
		}
		out.text += fmt.Sprintf("%s seq %d %s %s", cm.Name, w.Seq, w.Op, fmtAge(d))
		if d > wait {
			out.mark = diag.Critical
		}
	}
	if out.text == "" {
		return plain("-")
	}
	return out
}

func pdCell(sv diag.ServerSample, rank int) string {
	if sv.PD == nil {
		return "-"
	}
	for _, r := range sv.PD.Ranks {
		if r.Rank != rank {
			continue
		}
		var parts []string
		queues := debug.PDQueuesOf(sv.Role)
		for _, q := range debug.PDQueues {
			// The role's queues; for a role without its own, those that
			// hold something.
			if n := r.Counts[q]; slices.Contains(queues, q) || (queues == nil && n > 0) {
				parts = append(parts, fmt.Sprintf("%s=%d", q, n))
			}
		}
		if !r.Socket.Alive {
			parts = append(parts, "loop dead")
		}
		return strings.Join(parts, " ")
	}
	return "-"
}

func kvCell(sv diag.ServerSample, rank int) string {
	if sv.Requests == nil {
		return "-"
	}
	for _, kv := range sv.Requests.KV {
		if kv.Rank == rank {
			return fmt.Sprintf("%d/%d/%d", kv.Held(), kv.Cached, kv.Total)
		}
	}
	return "-"
}

// fmtAge renders a duration in milliseconds below a second, then in tenths
// of seconds.
func fmtAge(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	if d < time.Second {
		return d.Round(time.Millisecond).String()
	}
	return d.Round(100 * time.Millisecond).String()
}

// table aligns rows in columns two spaces apart, the first row a header.
func (o FrameOptions) table(rows [][]cell) string {
	widths := map[int]int{}
	for _, r := range rows {
		for i, c := range r {
			widths[i] = max(widths[i], lipgloss.Width(c.text))
		}
	}
	var b strings.Builder
	for n, r := range rows {
		var line strings.Builder
		for i, c := range r {
			text := c.text
			if i < len(r)-1 {
				text += strings.Repeat(" ", widths[i]-lipgloss.Width(c.text)+2)
			}
			switch {
			case n == 0:
				text = o.style(styleHeader, c.text) + strings.Repeat(" ", len(text)-len(c.text))
			case c.mark != 0:
				text = o.mark(c.mark, c.text) + strings.Repeat(" ", len(text)-len(c.text))
			}
			line.WriteString(text)
		}
		b.WriteString(strings.TrimRight(line.String(), " ") + "\n")
	}
	return b.String()
}

func (o FrameOptions) style(s lipgloss.Style, text string) string {
	if !o.Styled {
		return text
	}
	return s.Render(text)
}

func (o FrameOptions) mark(sev diag.Severity, text string) string {
	switch sev {
	case diag.Critical:
		return o.style(styleCritical, text)
	case diag.Warning:
		return o.style(styleWarning, text)
	case diag.Info:
		return o.style(styleDim, text)
	}
	return text
}

// cut shortens every line of s to o.Width cells.
func (o FrameOptions) cut(s string) string {
	if o.Width <= 0 {
		return s
	}
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if lipgloss.Width(l) > o.Width {
			lines[i] = truncate(l, o.Width)
		}
	}
	return strings.Join(lines, "\n")
}
