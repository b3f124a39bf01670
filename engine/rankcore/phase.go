package rankcore

import (
	"fmt"

	"github.com/pdkit/pdkit/engine/dist"
)

// Phase is one agreement of a rank's iteration: a value every rank
// proposes and the group reduces or broadcasts on one communicator.
type Phase uint8

// The phases, in the order of the lock-step table. Their names are those
// of the decision log and the flight recorder's tags.
const (
	Input     Phase = iota // rank 0's step input, broadcast
	Poll                   // one KVPoll vote per PD room, MIN
	Admit                  // the prefix-cache matches of the requests joining, MIN
	Room                   // free pages and free sequence rows, MIN
	PDFork                 // free pages and rows for a decode arrival's samples, MIN
	Agree                  // the plan's digest and its negation, MAX
	Forward                // the model's own collectives over the batch
	Results                // rank 0's sampled tokens and the step's aborts, broadcast
	Fork                   // free pages and rows for the samples of a first token, MIN
	NumPhases              // the number of phases, for arrays indexed by phase
)

// Comm names a communicator of the rank group.
type Comm uint8

const (
	Control Comm = iota // the loop's agreements
	Fwd                 // the forward pass's collectives
)

func (c Comm) String() string {
	if c == Fwd {
		return "forward"
	}
	return "control"
}

// phaseInfo is what a phase is, whatever table it sits in.
type phaseInfo struct {
	name     string
	comm     Comm
	op       dist.Op // OpNone: the model's own collectives, on the forward communicator
	proposes string  // what each rank contributes
}

var phases = [NumPhases]phaseInfo{
	Input:   {"input", Control, dist.OpBroadcast, "rank 0: the inbox's requests and aborts, its clock, the switches"},
	Poll:    {"poll", Control, dist.OpAllReduceMin, "one KVPoll vote per PD room, from the rank's own mail and sends"},
	Admit:   {"admit", Control, dist.OpAllReduceMin, "per joining request: device match, device+host match, -device match"},
	Room:    {"room", Control, dist.OpAllReduceMin, "free pages (free + evictable cached) and free sequence rows"},
	PDFork:  {"pd_fork", Control, dist.OpAllReduceMin, "free pages and rows, after the decode's grant"},
	Agree:   {"agree", Control, dist.OpAllReduceMax, "the plan's digest and its negation"},
	Forward: {"forward", Fwd, dist.OpNone, "the rank's shard of the batch (the model's all-reduces)"},
	Results: {"results", Control, dist.OpBroadcast, "rank 0: the sampled tokens, the aborts that came during the step"},
	Fork:    {"fork", Control, dist.OpAllReduceMin, "free pages and rows, once first tokens are appended"},
}

// String is the phase's name in the decision log and the flight recorder.
func (p Phase) String() string {
	if p < NumPhases {
		return phases[p].name
	}
	return fmt.Sprintf("phase(%d)", uint8(p))
}

// Comm is the communicator the phase runs on.
func (p Phase) Comm() Comm { return phases[p].comm }

// Op is the phase's collective; for Forward, OpNone stands for the
// model's own collectives, which the model calls.
func (p Phase) Op() dist.Op { return phases[p].op }

// Proposes says what every rank contributes to the phase.
func (p Phase) Proposes() string { return phases[p].proposes }

// ParsePhase is the phase named name.
func ParsePhase(name string) (Phase, error) {
	for p := range NumPhases {
		if phases[p].name == name {
			return p, nil
		}
	}
	return 0, fmt.Errorf("rankcore: no phase %q", name)
}

// Phases are every phase, in the lock-step table's order.
func Phases() []Phase {
	out := make([]Phase, NumPhases)
	for p := range NumPhases {
		out[p] = p
	}
	return out
}
