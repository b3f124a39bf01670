package serve

import (
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/clock"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// TestManualClockBootstrapTimeout: a prefill's bootstrap timeout is judged
// on Config.Clock alone. With a Manual clock the room waits through any
// amount of real time and through an advance to exactly the bound, and
// fails with the timeout's reason at the first iteration after the clock
// passes it: the test reaches a 10s timeout without waiting for it, and
// the outcome does not depend on how loaded the machine is.
func TestManualClockBootstrapTimeout(t *testing.T) {
	m := tinyModel(t)
	clk := clock.NewManual(time.Now())
	cfg := abortCfg()
	cfg.Role, cfg.Clock = pdproto.RolePrefill, clk
	cfg.PD.BootstrapTimeout = 10 * time.Second
	e := newEngine(t, m, cfg)
	q := Request{Prompt: testmodel.Prompts(3, 1, 10, 10, m.Config.VocabSize)[0], MaxTokens: 4, IgnoreEOS: true}
	p := submitHalf(t, e, q, newAbortRoom(), "")
	waitfor.Check(t, "prefill bootstrap", abortFinishWithin, func() bool { return inQueue(e, p.s.ID, "bootstrap") })

	// afterAdvance waits for two more iterations of rank 0: the second
	// took its step input, the clock, after the advance.
	afterAdvance := func() {
		t.Helper()
		step := e.View().LastStep().Step
		waitfor.Check(t, "two iterations after the advance", abortFinishWithin, func() bool { return e.View().LastStep().Step >= step+2 })
	}
	clk.Advance(cfg.PD.BootstrapTimeout) // the bound itself: not past it
	afterAdvance()
	if !inQueue(e, p.s.ID, "bootstrap") {
		t.Fatalf("the room left bootstrap at its bound: %v", e.PD().QueueEntries()[0])
	}
	clk.Advance(time.Nanosecond)
	expectEnd(t, "prefill", p.s, finishHas("no word from the decode within 10s"))
	if got := clk.Now(); !e.View().Now().Equal(got) {
		t.Errorf("View.Now %v, want the engine's clock %v", e.View().Now(), got)
	}
}
