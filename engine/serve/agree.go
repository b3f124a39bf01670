package serve

import (
	"context"
	"fmt"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/rankcore"
)

// agreer is a rank's side of its loop's table (engine/rankcore): the
// control communicator, the cursor that holds the rank to the table's
// order, and the decision log the agreed values go to. Every collective
// the loop runs itself goes through it: a phase is entered in the cursor
// (refused out of order before any rank waits), its operation comes from
// the phase, the call is tagged with the phase's name, and what was agreed
// is logged.
type agreer struct {
	r      int
	comm   *dist.Comm // the rank's control communicator
	fwd    *dist.Comm // its forward one, whose seqs the log records too
	cursor *rankcore.Cursor
	log    *decisionLog
	buf    []byte // the step input re-encoded for its digest
}

func newAgreer(r int, control, forward *dist.Comm, t *rankcore.Table, logLen int) *agreer {
	return &agreer{r: r, comm: control, fwd: forward, cursor: rankcore.NewCursor(t), log: newDecisionLog(logLen)}
}

// phaseCtx is the loops' context tagged with each phase's name, which the
// flight recorder keeps and the collective layer checks across ranks.
var phaseCtx = func() (c [rankcore.NumPhases]context.Context) {
	for _, p := range rankcore.Phases() {
		c[p] = dist.WithTag(ctx, p.String())
	}
	return c
}()

// table is the loop's table of phases (engine/rankcore).
func (c Config) table() *rankcore.Table {
	if c.Schedule == ScheduleOverlap {
		return &rankcore.Overlap
	}
	return &rankcore.Lockstep
}

// runs says whether phase p's next row in the table runs on the agreed
// facts f: the row's condition, never the executor's own.
func (a *agreer) runs(p rankcore.Phase, f rankcore.Facts) bool { return a.cursor.Runs(p, f) }

// ints runs phase p's reduction of the rank's proposal vals, as its table
// says, and logs the agreed values.
func (a *agreer) ints(p rankcore.Phase, vals []int64) error {
	if err := a.cursor.Enter(p); err != nil {
		return fmt.Errorf("serve: rank %d: %w", a.r, err)
	}
	var err error
	switch p.Op() {
	case dist.OpAllReduceMin:
		err = a.comm.AllReduceMinInt(phaseCtx[p], vals)
	case dist.OpAllReduceMax:
		err = a.comm.AllReduceMaxInt(phaseCtx[p], vals)
	default:
		return fmt.Errorf("serve: rank %d: phase %s is no reduction", a.r, p)
	}
	if err != nil {
		return fmt.Errorf("serve: rank %d: %s: %w", a.r, p, err)
	}
	a.log.agreed(p, a.comm.LastSeq(), vals)
	return nil
}

// bytes runs phase p's broadcast of rank 0's data, as its table says, and
// logs it; the step input is logged once decoded (input).
func (a *agreer) bytes(p rankcore.Phase, data []byte) ([]byte, error) {
	if err := a.cursor.Enter(p); err != nil {
		return nil, fmt.Errorf("serve: rank %d: %w", a.r, err)
	}
	if p.Op() != dist.OpBroadcast {
		return nil, fmt.Errorf("serve: rank %d: phase %s is no broadcast", a.r, p)
	}
	got, err := a.comm.BroadcastBytes(phaseCtx[p], 0, data)
	if err != nil {
		return nil, fmt.Errorf("serve: rank %d: %s: %w", a.r, p, err)
	}
	if p != rankcore.Input {
		a.log.agreedBytes(p, a.comm.LastSeq(), got)
	}
	return got, nil
}

// input opens step's record in the log with the decoded step input.
func (a *agreer) input(step uint64, in stepInput) {
	a.buf = a.log.openInput(step, in, a.comm.LastSeq(), a.fwd.LastSeq(), a.buf)
}

// forward enters the forward pass in the table before its first
// collective on the forward communicator.
func (a *agreer) forward() error {
	if err := a.cursor.Enter(rankcore.Forward); err != nil {
		return fmt.Errorf("serve: rank %d: %w", a.r, err)
	}
	return nil
}

// published closes the iteration's record with rec, stamped with the seqs
// the iteration ended at on both communicators.
func (a *agreer) published(rec *StepRecord) {
	rec.ControlSeq, rec.ForwardSeq = a.comm.LastSeq(), a.fwd.LastSeq()
	a.log.close(*rec)
}
