package debug

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// DecisionsPath is GET /debug/v1/decisions: every rank's decision log
// (optional ?since=STEP: only the records of later steps).
const DecisionsPath = "/debug/v1/decisions"

// DecisionsResponse is the body of GET /debug/v1/decisions.
type DecisionsResponse struct {
	// LogLen is the iterations each rank's log keeps.
	LogLen int `json:"log_len"`
	// Since is the filter asked for: records of later steps only (0: all).
	Since uint64          `json:"since"`
	Ranks []RankDecisions `json:"ranks"`
	// Divergence is the first step whose records differ between ranks
	// (FirstDivergence over Ranks); null when they agree.
	Divergence *Divergence `json:"divergence"`
}

// RankDecisions is one rank's decision log.
type RankDecisions struct {
	Rank int `json:"rank"`
	// LastStep is the step of the rank's last finished iteration, whether
	// or not the filter kept its record.
	LastStep uint64 `json:"last_step"`
	// Records are the finished iterations, newest last.
	Records []DecisionRecord `json:"records"`
	// Open is the iteration in progress: what it agreed so far. Null
	// between iterations; a rank waiting in the next step's input
	// broadcast has an open record with no agreements (on an idle server
	// the other ranks wait there for rank 0).
	Open *DecisionRecord `json:"open"`
	// Waiting is the collective the rank waits in now; null when none.
	Waiting *DecisionWait `json:"waiting"`
}

// DecisionRecord is one rank's decisions in one iteration: the input it
// applied, every value agreed over the control communicator, the plan and
// the batch. Ranks in lock-step have equal records, end times apart.
type DecisionRecord struct {
	Step uint64 `json:"step"`
	// Open marks the iteration in progress (RankDecisions.Open).
	Open  bool          `json:"open,omitempty"`
	Input DecisionInput `json:"input"`
	// Agreed are the control communicator's collectives of the iteration,
	// in order, with the values agreed; the first is the input broadcast.
	Agreed []Agreement `json:"agreed"`
	// Plan is the agreed plan's digest, 16 hex digits; "" when the
	// iteration scheduled nothing.
	Plan        string `json:"plan"`
	Phase       string `json:"phase"` // idle, prefill, decode or mixed; "" while open
	BatchSize   int    `json:"batch_size"`
	BatchTokens int    `json:"batch_tokens"`
	// ControlSeq and ForwardSeq are the rank's last seqs on each
	// communicator when the iteration ended; the forward pass ran
	// forward_first..forward_seq (none when forward_first is greater).
	ControlSeq   uint64 `json:"control_seq"`
	ForwardFirst uint64 `json:"forward_first"`
	ForwardSeq   uint64 `json:"forward_seq"`
	// End is null while open.
	End *time.Time `json:"end"`
}

// DecisionInput is the step input a rank applied, as broadcast by rank 0.
type DecisionInput struct {
	NowMS  float64 `json:"now_ms"` // the agreed clock: rank 0's, since the engine started
	Adds   int     `json:"adds"`
	Aborts int     `json:"aborts"`
	// IDs is the FNV-1a of the adds' and aborts' request ids, 16 hex
	// digits.
	IDs           string `json:"ids"`
	HiCache       string `json:"hicache,omitempty"` // a host-tier switch: on or off
	IndexK        string `json:"index_k,omitempty"` // an index-K precision switched to
	OffloadTokens int    `json:"offload_tokens,omitempty"`
	// Digest is the FNV-1a of the whole input as broadcast, 16 hex digits.
	Digest string `json:"digest"`
}

// The agreements of an iteration, in order, as in Agreement.Name.
var Agreements = []string{"input", "poll", "admit", "room", "pd_fork", "agree", "results", "fork"}

// Agreement is one collective of an iteration on the control communicator
// and what it agreed.
type Agreement struct {
	// Name is what was agreed: input (the step input broadcast), poll (the
	// PD rooms' votes), admit (the prefix matches of the requests
	// joining), room (free pages and rows), pd_fork (room for a decode
	// arrival's samples), agree (the plan digest), results (the step
	// output broadcast), fork (room for a first token's samples).
	Name string `json:"name"`
	Op   string `json:"op"`
	Seq  uint64 `json:"seq"`
	Len  int    `json:"len"` // elements reduced, or bytes broadcast
	// Digest is the FNV-1a of the agreed values or bytes, 16 hex digits.
	Digest string `json:"digest"`
	// Values are the agreed values when there are at most two (room and
	// forks: free pages and rows).
	Values []int64 `json:"values,omitempty"`
}

// DecisionWait is the collective a rank waits in.
type DecisionWait struct {
	Comm     string    `json:"comm"`
	Seq      uint64    `json:"seq"`
	Op       string    `json:"op"`
	Since    time.Time `json:"since"`
	WaitedMS float64   `json:"waited_ms"`
}

// Divergence is the first step at which ranks' decision logs part.
type Divergence struct {
	Step uint64 `json:"step"`
	// What differs first: "input", an agreement's name (its value),
	// "collectives" (the ranks ran different collectives: another op or
	// seq, one more or one fewer, or a rank waits in one its peer's
	// finished step did not run), "plan", "batch" or "seqs".
	What   string `json:"what"`
	Detail string `json:"detail"`
	// Ranks are the ranks whose records of the step were compared, and
	// Records those records (open ones marked), in the same order.
	Ranks   []int            `json:"ranks"`
	Records []DecisionRecord `json:"records"`
}

// FirstDivergence compares the ranks' logs step by step and returns the
// first step where two ranks' records differ, or nil. A finished record is
// compared whole (end time apart); an open one as far as it got: its
// agreements must begin the finished record's, and the collective its rank
// waits in must be the finished one's next at that seq. A rank that has not
// reached a step is not a divergence: a live read often catches ranks one
// step apart, and a rank stalled outside the collectives shows as one step
// behind (LastStep and Open), with nothing differing.
func FirstDivergence(ranks []RankDecisions) *Divergence {
	type entry struct {
		rank int
		rec  DecisionRecord
		wait *DecisionWait
	}
	var steps []uint64
	at := map[uint64][]entry{}
	for _, rd := range ranks {
		for _, r := range rd.Records {
			at[r.Step] = append(at[r.Step], entry{rank: rd.Rank, rec: r})
			steps = append(steps, r.Step)
		}
		if o := rd.Open; o != nil {
			rec := *o
			rec.Open = true
			at[o.Step] = append(at[o.Step], entry{rank: rd.Rank, rec: rec, wait: rd.Waiting})
			steps = append(steps, o.Step)
		}
	}
	slices.Sort(steps)
	for _, s := range slices.Compact(steps) {
		es := at[s]
		for i := 1; i < len(es); i++ {
			a, b := es[0], es[i]
			what, detail := compareDecisions(a.rank, a.rec, a.wait, b.rank, b.rec, b.wait)
			if what == "" {
				continue
			}
			d := &Divergence{Step: s, What: what, Detail: detail}
			for _, e := range es {
				d.Ranks = append(d.Ranks, e.rank)
				d.Records = append(d.Records, e.rec)
			}
			return d
		}
	}
	return nil
}

// compareDecisions returns what differs first between two ranks' records
// of one step, and how; "" when nothing does.
func compareDecisions(ra int, a DecisionRecord, wa *DecisionWait, rb int, b DecisionRecord, wb *DecisionWait) (string, string) {
	if a.Open && !b.Open {
		// The finished one first.
		ra, a, wa, rb, b, wb = rb, b, wb, ra, a, wa
	}
	// An open record's wait counts only on the control communicator and
	// after what the record agreed (an older read is not a divergence).
	if wb != nil && (wb.Comm != CommControl || len(b.Agreed) > 0 && wb.Seq <= b.Agreed[len(b.Agreed)-1].Seq) {
		wb = nil
	}
	if wa != nil && (wa.Comm != CommControl || len(a.Agreed) > 0 && wa.Seq <= a.Agreed[len(a.Agreed)-1].Seq) {
		wa = nil
	}
	if a.Input != b.Input && !(a.Open && len(a.Agreed) == 0) && !(b.Open && len(b.Agreed) == 0) {
		return "input", fmt.Sprintf("rank %d applied input %s (%d adds, %d aborts, ids %s), rank %d input %s (%d adds, %d aborts, ids %s)",
			ra, a.Input.Digest, a.Input.Adds, a.Input.Aborts, a.Input.IDs, rb, b.Input.Digest, b.Input.Adds, b.Input.Aborts, b.Input.IDs)
	}
	for i := range max(len(a.Agreed), len(b.Agreed)) {
		switch {
		case i >= len(b.Agreed) && b.Open:
			// b has not got that far: it must wait in a's next
			// collective, if in one.
			next := a.Agreed[i]
			if wb != nil && (wb.Seq != next.Seq || wb.Op != next.Op) {
				return "collectives", fmt.Sprintf("rank %d waits in %s at control seq %d; rank %d ran %s (%s) there", rb, wb.Op, wb.Seq, ra, next.Op, next.Name)
			}
			return "", ""
		case i >= len(a.Agreed) && a.Open:
			next := b.Agreed[i]
			if wa != nil && (wa.Seq != next.Seq || wa.Op != next.Op) {
				return "collectives", fmt.Sprintf("rank %d waits in %s at control seq %d; rank %d ran %s (%s) there", ra, wa.Op, wa.Seq, rb, next.Op, next.Name)
			}
			return "", ""
		case i >= len(b.Agreed):
			return "collectives", fmt.Sprintf("rank %d ran %s (%s) at control seq %d; rank %d ended the step without it", ra, a.Agreed[i].Op, a.Agreed[i].Name, a.Agreed[i].Seq, rb)
		case i >= len(a.Agreed):
			return "collectives", fmt.Sprintf("rank %d ran %s (%s) at control seq %d; rank %d ended the step without it", rb, b.Agreed[i].Op, b.Agreed[i].Name, b.Agreed[i].Seq, ra)
		}
		x, y := a.Agreed[i], b.Agreed[i]
		if x.Name != y.Name || x.Op != y.Op || x.Seq != y.Seq {
			return "collectives", fmt.Sprintf("rank %d ran %s (%s) at control seq %d, rank %d %s (%s) at control seq %d", ra, x.Op, x.Name, x.Seq, rb, y.Op, y.Name, y.Seq)
		}
		if x.Len != y.Len || x.Digest != y.Digest || !slices.Equal(x.Values, y.Values) {
			return x.Name, fmt.Sprintf("at control seq %d rank %d agreed %s, rank %d %s", x.Seq, ra, agreedText(x), rb, agreedText(y))
		}
	}
	if a.Open { // and b: they agreed alike so far
		if wa != nil && wb != nil && wa.Seq == wb.Seq && wa.Op != wb.Op {
			return "collectives", fmt.Sprintf("at control seq %d rank %d waits in %s, rank %d in %s", wa.Seq, ra, wa.Op, rb, wb.Op)
		}
		return "", ""
	}
	if b.Open {
		if wb != nil {
			return "collectives", fmt.Sprintf("rank %d waits in %s at control seq %d in step %d; rank %d ended the step at control seq %d", rb, wb.Op, wb.Seq, b.Step, ra, a.ControlSeq)
		}
		return "", ""
	}
	if a.Plan != b.Plan {
		return "plan", fmt.Sprintf("rank %d planned %q, rank %d %q", ra, a.Plan, rb, b.Plan)
	}
	if a.Phase != b.Phase || a.BatchSize != b.BatchSize || a.BatchTokens != b.BatchTokens {
		return "batch", fmt.Sprintf("rank %d ran %s %d×%d tokens, rank %d %s %d×%d", ra, a.Phase, a.BatchSize, a.BatchTokens, rb, b.Phase, b.BatchSize, b.BatchTokens)
	}
	if a.ControlSeq != b.ControlSeq || a.ForwardFirst != b.ForwardFirst || a.ForwardSeq != b.ForwardSeq {
		return "seqs", fmt.Sprintf("rank %d ended at control %d, forward %d..%d; rank %d at control %d, forward %d..%d",
			ra, a.ControlSeq, a.ForwardFirst, a.ForwardSeq, rb, b.ControlSeq, b.ForwardFirst, b.ForwardSeq)
	}
	return "", ""
}

func agreedText(a Agreement) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s over %d", a.Digest, a.Len)
	if len(a.Values) > 0 {
		fmt.Fprintf(&b, " %v", a.Values)
	}
	return b.String()
}
