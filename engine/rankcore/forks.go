package rankcore

import (
	"fmt"
	"strings"

	"github.com/pdkit/pdkit/engine/sched"
)

// Samples of one prompt (n > 1): the first sample, the parent, is the
// request the ranks admit; its later samples, ids parent+1 .. parent+n-1,
// fork from its KV once it holds the prompt's. What follows decides, from
// values every rank holds alike, which samples fork, wait or end; the
// executor copies the KV, adds to the scheduler and ends the streams.

// Forks is, by parent id, the number of a parent's later samples not
// forked yet: a budget every rank keeps alike from the step input. A
// budget is spent once, by whichever comes first: the parent's first
// token (Take), or its end (Drop). The zero Forks is empty and ready.
type Forks struct{ pending map[uint64]int }

// Expect records a request of n samples: n-1 wait for its first token.
// A request of one sample has nothing to fork.
func (f *Forks) Expect(parent uint64, n int) {
	if n <= 1 {
		return
	}
	if f.pending == nil {
		f.pending = make(map[uint64]int)
	}
	f.pending[parent] = n - 1
}

// Pending is the number of parent's samples not forked yet, without
// spending them: what rank 0 samples first tokens for, and what the step
// output holds after the parent's token.
func (f *Forks) Pending(parent uint64) int { return f.pending[parent] }

// Take spends parent's budget at its first token: the number of samples
// to fork now; zero once spent.
func (f *Forks) Take(parent uint64) int {
	n := f.pending[parent]
	delete(f.pending, parent)
	return n
}

// Drop spends parent's budget as it ends before its first token: the ids
// of the samples that end with it; none once spent.
func (f *Forks) Drop(parent uint64) []uint64 {
	n := f.Take(parent)
	if n == 0 {
		return nil
	}
	ids := make([]uint64, n)
	for i := range ids {
		ids[i] = parent + uint64(i) + 1
	}
	return ids
}

// Len is the number of parents with samples pending.
func (f *Forks) Len() int { return len(f.pending) }

// Capacity is what the ranks agreed they can allocate, in the room,
// pd_fork or fork phase: the least over the ranks of their free pages
// (free plus evictable cached) and free sequence rows.
type Capacity struct{ Pages, Rows int }

// First is a parent whose first token the step sampled, with the facts
// every rank holds of it.
type First struct {
	Parent    uint64
	Prompt    int    // the prompt's tokens: the KV each fork copies
	MaxTokens int    // the parent's max_tokens
	Stops     []bool // per later sample, whether its first token stops it
}

// Arrival is a PD decode arrival whose later samples fork. The transfer
// brought the first token of the parent only: each later sample copies
// all but the prompt's last token and runs that token itself, to sample
// its own first token.
type Arrival struct {
	Parent  uint64
	Samples int  // later samples
	Prompt  int  // the prompt's tokens
	Held    bool // the parent's sequence is still in the pool (not aborted since it arrived)
}

// Act is what a sample does in a fork plan.
type Act uint8

const (
	ActFork Act = iota // start on a copy of the parent's KV and join the scheduler
	ActWait            // join the scheduler's waiting queue without KV, as a retracted request
	ActEnd             // end at once, holding nothing
)

func (a Act) String() string {
	switch a {
	case ActFork:
		return "fork"
	case ActWait:
		return "wait"
	case ActEnd:
		return "end"
	}
	return fmt.Sprintf("act(%d)", uint8(a))
}

// Why is the reason for a sample's act.
type Why uint8

const (
	WhyFits       Why = iota // fork: its pages and a row fit the room left
	WhyNoCopy                // fork: a one-token prompt leaves nothing to copy, and takes no room
	WhyNoPages               // wait: its pages do not fit the room left
	WhyNoRow                 // wait: no sequence row is left
	WhyFirstStops            // end: its first token stops it
	WhyOneToken              // end: the parent's max_tokens is 1
	WhyParentGone            // end: the arrival's sequence went (aborted) before its samples forked
)

func (w Why) String() string {
	switch w {
	case WhyFits:
		return "fits the room"
	case WhyNoCopy:
		return "nothing to copy"
	case WhyNoPages:
		return "its pages do not fit: busy, not dead"
	case WhyNoRow:
		return "no row left: busy, not dead"
	case WhyFirstStops:
		return "its first token stops it"
	case WhyOneToken:
		return "max_tokens 1"
	case WhyParentGone:
		return "its parent is gone"
	}
	return fmt.Sprintf("why(%d)", uint8(w))
}

// Sample is the plan for one later sample.
type Sample struct {
	ID, Parent uint64
	Of         int // its parent's index in the plan's input
	Index      int // its index among its parent's later samples (ID = Parent+1+Index)
	Act        Act
	Why        Why
	End        sched.Reason // with ActEnd: how it ends
	Copy       int          // with ActFork: the parent's tokens whose KV it copies
	Pages      int          // with ActFork: the pages it takes from the room
}

func (s Sample) String() string {
	switch s.Act {
	case ActFork:
		return fmt.Sprintf("%d of %d: fork: copies %d tokens, takes %d pages (%s)", s.ID, s.Parent, s.Copy, s.Pages, s.Why)
	case ActEnd:
		return fmt.Sprintf("%d of %d: end %s (%s)", s.ID, s.Parent, s.End, s.Why)
	}
	return fmt.Sprintf("%d of %d: %s (%s)", s.ID, s.Parent, s.Act, s.Why)
}

// ForkPlan is what every rank does with the samples of a fork phase, in
// order, and the room the forks leave.
type ForkPlan struct {
	Samples []Sample
	Left    Capacity
}

func (p ForkPlan) String() string {
	var b strings.Builder
	for _, s := range p.Samples {
		b.WriteString(s.String())
		b.WriteByte('\n')
	}
	fmt.Fprintf(&b, "left: %d pages, %d rows\n", p.Left.Pages, p.Left.Rows)
	return b.String()
}

// PlanFirstForks plans the samples of the parents whose first tokens the
// step sampled, in order, within the agreed room: a sample whose first
// token stops it, or whose parent may emit one token, ends at once; the
// others fork, one row and the prompt's pages each, until the room runs
// out, and the rest wait. Waiting is not failing: busy is not dead.
func PlanFirstForks(room Capacity, pageSize int, parents []First) ForkPlan {
	var out []Sample
	for i, p := range parents {
		need := pagesFor(p.Prompt, pageSize)
		for j, stop := range p.Stops {
			s := Sample{ID: p.Parent + uint64(j) + 1, Parent: p.Parent, Of: i, Index: j}
			switch {
			case stop:
				s.Act, s.Why, s.End = ActEnd, WhyFirstStops, sched.ReasonStop
			case p.MaxTokens == 1:
				s.Act, s.Why, s.End = ActEnd, WhyOneToken, sched.ReasonLength
			case need > room.Pages:
				s.Act, s.Why = ActWait, WhyNoPages
			case room.Rows < 1:
				s.Act, s.Why = ActWait, WhyNoRow
			default:
				s.Act, s.Why, s.Copy, s.Pages = ActFork, WhyFits, p.Prompt, need
				room.Pages, room.Rows = room.Pages-need, room.Rows-1
			}
			out = append(out, s)
		}
	}
	return ForkPlan{Samples: out, Left: room}
}

// PlanArrivalForks plans the later samples of the decode arrivals, in
// order, within the agreed room: each copies all but its prompt's last
// token; one that does not fit waits, and an arrival aborted since it
// arrived ends its samples.
func PlanArrivalForks(room Capacity, pageSize int, arrivals []Arrival) ForkPlan {
	var out []Sample
	for i, a := range arrivals {
		copied := a.Prompt - 1
		need := pagesFor(copied, pageSize)
		for j := range a.Samples {
			s := Sample{ID: a.Parent + uint64(j) + 1, Parent: a.Parent, Of: i, Index: j}
			switch {
			case !a.Held:
				s.Act, s.Why, s.End = ActEnd, WhyParentGone, sched.ReasonAbort
			case need > room.Pages:
				s.Act, s.Why = ActWait, WhyNoPages
			case copied > 0 && room.Rows < 1:
				s.Act, s.Why = ActWait, WhyNoRow
			case copied > 0:
				s.Act, s.Why, s.Copy, s.Pages = ActFork, WhyFits, copied, need
				room.Pages, room.Rows = room.Pages-need, room.Rows-1
			default:
				s.Act, s.Why = ActFork, WhyNoCopy
			}
			out = append(out, s)
		}
	}
	return ForkPlan{Samples: out, Left: room}
}

// pagesFor is the pages tokens take at pageSize tokens a page.
func pagesFor(tokens, pageSize int) int { return (tokens + pageSize - 1) / pageSize }
