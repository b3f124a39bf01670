package rankcore

import (
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
)

// Row is one phase in a table: which iteration it belongs to and when it
// runs. Whether a row runs depends on agreed values only (the broadcast
// input, earlier rows' agreed values, the scheduler and the PD machine,
// which every rank holds alike), so every rank runs the same rows.
type Row struct {
	Phase Phase
	// Of is the iteration the row serves: "N", the iteration whose input
	// opens the table, or "N-1", the step still in flight (overlap).
	Of string
	// When is the agreed condition under which the row runs, in words;
	// If is the same condition as code, over the agreed facts.
	When string
	If   func(Facts) bool
}

// Facts are the agreed values the rows' conditions read: every rank holds
// them alike where it asks, so every rank runs the same rows. The
// executor fills in what the row it asks about reads.
type Facts struct {
	Rooms     int  // rooms the PD machine holds
	Joining   int  // requests joining the scheduler in this iteration
	PrefixOn  bool // the prefix cache is on (a setting every rank shares)
	Scheduled int  // requests the scheduler holds
	Arrivals  int  // decode arrivals whose later samples fork
	Batch     int  // items the agreed plan runs
	Firsts    int  // parents of n > 1 samples whose first token the step sampled
	InFlight  bool // a step is in flight (overlap)
	Replan    bool // the landed step left the plan empty (overlap)
}

// The rows' conditions.
var (
	always    = func(Facts) bool { return true }
	hasRooms  = func(f Facts) bool { return f.Rooms > 0 }
	matches   = func(f Facts) bool { return f.Joining > 0 && f.PrefixOn }
	hasWork   = func(f Facts) bool { return f.Joining > 0 || f.Scheduled > 0 || f.Rooms > 0 }
	forksIn   = func(f Facts) bool { return f.Arrivals > 0 }
	scheduled = func(f Facts) bool { return f.Scheduled > 0 }
	runsBatch = func(f Facts) bool { return f.Batch > 0 }
	firsts    = func(f Facts) bool { return f.Firsts > 0 }
	lands     = func(f Facts) bool { return f.InFlight }
	replans   = func(f Facts) bool { return f.Replan && f.Scheduled > 0 }
)

// Table is the order of one loop's phases: the executor runs a table's
// rows in order, skipping those whose condition does not hold, and may end
// an iteration after any row; the next iteration starts again at the first
// row, the step input.
type Table struct {
	Name string
	Rows []Row
}

// frontRows are the rows every loop runs first, up to the agreed plan.
var frontRows = []Row{
	{Input, "N", "every iteration", always},
	{Poll, "N", "the PD machine holds rooms", hasRooms},
	{Admit, "N", "requests join the scheduler and the prefix cache is on", matches},
	{Room, "N", "there is work: requests joining, scheduled or PD rooms", hasWork},
	{PDFork, "N", "a decode arrival of n > 1 samples forks", forksIn},
	{Agree, "N", "the scheduler holds requests", scheduled},
}

// Lockstep is the lock-step loop: each step's forward pass in line with
// the rest of its iteration.
var Lockstep = Table{Name: "lockstep", Rows: append(slices.Clip(frontRows),
	Row{Forward, "N", "the plan runs a batch", runsBatch},
	Row{Results, "N", "the plan ran a batch", runsBatch},
	Row{Fork, "N", "a request of n > 1 samples sampled its first tokens", firsts},
)}

// Overlap is the overlap loop: step N's forward pass runs on the forward
// communicator while iteration N+1's rows up to agree run on the control
// one; N lands (results, fork) once N+1 is agreed.
var Overlap = Table{Name: "overlap", Rows: append(slices.Clip(frontRows),
	Row{Results, "N-1", "a step is in flight: it lands", lands},
	Row{Fork, "N-1", "a request of n > 1 samples sampled its first tokens in N-1", firsts},
	Row{Room, "N", "N-1 landed and left N's plan empty, and the scheduler holds requests: plan again", replans},
	Row{Agree, "N", "N was planned again", replans},
	Row{Forward, "N", "the plan runs a batch; the rows of N+1 up to agree run beside it", runsBatch},
)}

// Tables are the loops' tables.
func Tables() []Table { return []Table{Lockstep, Overlap} }

// String prints the table, one row a line.
func (t Table) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s:\n", t.Name)
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "  #\tphase\tof\tcomm\top\twhen")
	for i, r := range t.Rows {
		op := r.Phase.Op().String()
		if r.Phase == Forward {
			op = "(the model's)"
		}
		fmt.Fprintf(w, "  %d\t%s\t%s\t%s\t%s\t%s\n", i+1, r.Phase, r.Of, r.Phase.Comm(), op, r.When)
	}
	w.Flush()
	return b.String()
}

// PhaseList prints what every rank proposes in each phase, one phase a
// line.
func PhaseList() string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, p := range Phases() {
		fmt.Fprintf(w, "%s\t%s\n", p, p.Proposes())
	}
	w.Flush()
	return b.String()
}
