package rooms

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// randomSequences is how many random event sequences TestRandomSequences
// runs; -tags stress runs more (see stress_test.go).
var randomSequences = 10_000

// TestRandomSequences drives a TP group of 1 to 3 machines with seeded
// random event sequences (admissions, mail on some ranks, lost and
// restarted peers, failed sends, aborts, scheduler finishes, grants, the
// clock moving) and checks after every event that the invariants hold
// (Check, run by the machines themselves under -race), that every rank
// holds the same rooms in the same phases, and in the end that every room
// reached its end by the sum of its phases' deadlines. The scheduler and
// the executor are simulated the way the serve loop acts on the actions.
func TestRandomSequences(t *testing.T) {
	for seed := range uint64(randomSequences) {
		if err := runRandom(seed); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
}

// group is a simulated TP group with its scheduler and its pages.
type group struct {
	rng   *rand.Rand
	ms    []*Machine
	now   time.Duration
	admit map[uint64]time.Duration // room -> admission time, while live
	sched map[uint64]bool          // prefill rooms in the scheduler: cut?
	held  map[uint64]int           // decode: reserved sequences per room, over the ranks
	trace []string
	// The ledger, per rank: how often each request's stream ended (End,
	// Arrived, or a scheduler finish the machine left to the caller), and
	// which requests joined the scheduler (their chunks may go out).
	ends   []map[uint64]int
	joined []map[uint64]bool
}

func runRandom(seed uint64) (err error) {
	rng := rand.New(rand.NewPCG(seed, 0x9d))
	cfg := Config{Role: Role(rng.IntN(2)), PageSize: 1 + rng.IntN(4), IndexKDType: "fp8",
		BootstrapTimeout: time.Duration(2+rng.IntN(5)) * time.Second, TransferTimeout: time.Duration(2+rng.IntN(5)) * time.Second,
		InflightTimeout: time.Duration(2+rng.IntN(5)) * time.Second, AbortAckTimeout: time.Duration(1+rng.IntN(3)) * time.Second,
		HeartbeatTimeout: 3 * time.Second, ReservedDecodeTokens: rng.IntN(20) - 4,
		RequestTimeout: time.Duration(5+rng.IntN(15)) * time.Second, QueuedInterval: 500 * time.Millisecond}
	g := &group{rng: rng, admit: map[uint64]time.Duration{}, sched: map[uint64]bool{}, held: map[uint64]int{}}
	for r := range 1 + rng.IntN(3) {
		g.ends = append(g.ends, map[uint64]int{})
		g.joined = append(g.joined, map[uint64]bool{})
		cfg.Rank = r
		m, err := New(cfg)
		if err != nil {
			return err
		}
		g.ms = append(g.ms, m)
	}
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v\ntrace:\n%s", p, strings.Join(g.trace, "\n"))
		} else if err != nil {
			err = fmt.Errorf("%w\ntrace:\n%s", err, strings.Join(g.trace, "\n"))
		}
	}()
	// Every phase ends by the request timeout but Aborting, which holds
	// the pages at most the abort-ack timeout beyond it.
	limit := cfg.RequestTimeout + cfg.AbortAckTimeout + 2*time.Second
	next := uint64(1)
	for range 20 + rng.IntN(60) {
		if rng.IntN(4) == 0 {
			g.log("admit %d", next)
			req := Request{ID: next, Room: next, PromptLen: 1 + rng.IntN(12), MaxTokens: 1 + rng.IntN(30)}
			if cfg.Role == Decode {
				req.URL = "http://p"
			} else {
				req.MaxTokens = 1
			}
			for _, m := range g.ms {
				if err := m.Admit(g.now, req); err != nil {
					return err
				}
			}
			g.admit[next] = g.now
			next++
		}
		if err := g.event(); err != nil {
			return err
		}
		if err := g.iteration(); err != nil {
			return err
		}
		if err := g.checkAgree(); err != nil {
			return err
		}
		for id, at := range g.admit {
			if g.now-at > limit {
				return fmt.Errorf("request %d admitted at %v still live at %v (limit %v)", id, at, g.now, limit)
			}
		}
	}
	// Quiet: only the clock moves; everything must end.
	for range 60 {
		g.now += 500 * time.Millisecond
		if err := g.iteration(); err != nil {
			return err
		}
	}
	if len(g.admit) != 0 || g.ms[0].Len() != 0 {
		return fmt.Errorf("%d requests never ended: %+v", len(g.admit), g.ms[0].Entries())
	}
	for id, n := range g.held {
		if n != 0 {
			return fmt.Errorf("request %d: %d sequences still held", id, n)
		}
	}
	for r := range g.ms {
		for id := range next - 1 {
			if n := g.ends[r][id+1]; n != 1 {
				return fmt.Errorf("rank %d: request %d ended %d times, want once", r, id+1, n)
			}
		}
	}
	return nil
}

func (g *group) log(format string, args ...any) {
	g.trace = append(g.trace, fmt.Sprintf("t=%v ", g.now)+fmt.Sprintf(format, args...))
}

// event is one random rank-local or agreed happening.
func (g *group) event() error {
	rng := g.rng
	es := g.ms[0].Entries()
	if len(es) == 0 {
		return nil
	}
	e := es[rng.IntN(len(es))]
	r := rng.IntN(len(g.ms))
	m := g.ms[r]
	id := e.ID
	switch rng.IntN(13) {
	case 0:
		g.log("abort %d", id)
		for _, m := range g.ms {
			acts, handled := m.Abort(g.now, id, "client")
			if _, in := g.sched[id]; in && !handled {
				g.sched[id] = true // the caller cuts it in the scheduler
			}
			if err := g.exec(m, acts); err != nil {
				return err
			}
		}
	case 1:
		g.log("r%d send-failed %d", r, id)
		m.SendFailed(id, "a message", errors.New("timeout"))
	case 2:
		g.log("r%d peer lost", r)
		for _, p := range m.Peers() {
			m.Peer(p, Liveness{Silent: 4 * time.Second})
		}
	case 3:
		g.log("r%d peer boot", r)
		for _, p := range m.Peers() {
			m.Peer(p, Liveness{Boot: uint64(1 + rng.IntN(2))})
		}
	case 4:
		g.log("r%d status failed %d", r, id)
		g.file(m, id, Mail{Status: &pdproto.Status{Room: id, State: pdproto.Failed, Error: "x"}})
	case 5:
		g.log("r%d abort mail %d", r, id)
		g.file(m, id, Mail{Abort: &pdproto.Abort{Room: id, Endpoint: "tcp://d", Reason: "x"}})
	case 6:
		g.log("r%d acked %d", r, id)
		g.file(m, id, Mail{Acked: true})
	case 12:
		g.log("r%d queued %d", r, id)
		g.file(m, id, Mail{Queued: &pdproto.Queued{Room: id}})
	case 7:
		g.log("r%d resolve %d", r, id)
		if rng.IntN(5) == 0 {
			m.Resolve(id, Resolution{Err: errors.New("refused")})
		} else {
			m.Resolve(id, Resolution{Endpoint: "tcp://p"})
		}
	default:
		// The common path: every rank gets the peer's next message.
		for _, m := range g.ms {
			if g.rng.IntN(4) == 0 {
				continue // this rank's copy is late
			}
			g.progress(m, id)
		}
	}
	return nil
}

// progress delivers what the room's peer would send next on rank m.
func (g *group) progress(m *Machine, id uint64) {
	q := m.rooms[id]
	if q == nil {
		return
	}
	switch q.phase {
	case Bootstrap:
		dtype := "fp8"
		if g.rng.IntN(40) == 0 {
			dtype = "bf16" // a decode of the other precision: refused
		}
		g.file(m, id, Mail{Info: &pdproto.TransferInfo{Room: id, Endpoint: "tcp://d", Rank: uint32(m.cfg.Rank), Tokens: uint32(q.req.PromptLen), IndexKDType: dtype}})
	case Inflight:
		g.file(m, id, Mail{Status: &pdproto.Status{Room: id, State: pdproto.Success}})
	case Prealloc:
		m.Resolve(id, Resolution{Endpoint: "tcp://p"})
	case Transfer:
		start := q.sent
		if g.rng.IntN(40) == 0 {
			start++ // a gap: refused
		}
		end := min(q.req.PromptLen, start+4)
		start = min(start, end)
		ch := &pdproto.KVChunk{Room: id, Chunk: uint32(q.chunks), Start: uint32(start), End: uint32(end)}
		if end == q.req.PromptLen {
			tok := int32(1)
			if g.rng.IntN(40) == 0 {
				tok = int32(2 + m.cfg.Rank) // ranks disagree: refused by the poll
			}
			ch.Final = &pdproto.ChunkFinal{FirstToken: tok, PromptTokens: uint32(end)}
		}
		g.file(m, id, Mail{Chunks: []*pdproto.KVChunk{ch}})
	case Aborting:
		g.file(m, id, Mail{Acked: true})
	}
}

func (g *group) file(m *Machine, id uint64, mail Mail) {
	for _, a := range m.File(g.now, id, mail) {
		if ac, ok := a.(ApplyChunk); ok && g.rng.IntN(30) == 0 {
			m.Failed(ac.ID, Reason{Kind: KindBadChunk, Text: "write failed"})
		}
	}
}

// iteration is one loop iteration's PD part: the poll, the grant, the
// scheduler's finishes and a forward step's chunks.
func (g *group) iteration() error {
	g.now += time.Duration(g.rng.IntN(1500)) * time.Millisecond
	if g.ms[0].Len() > 0 {
		agreed, _ := Poll(g.ms, g.now)
		g.log("poll %s", formatVotes(agreed))
		for _, m := range g.ms {
			acts, err := m.Apply(g.now, agreed)
			if err != nil {
				return err
			}
			if err := g.exec(m, acts); err != nil {
				return err
			}
		}
	}
	b := Budget{FreePages: g.rng.IntN(20), FreeRows: g.rng.IntN(6), SchedGrowth: g.rng.IntN(4), SchedSlots: g.rng.IntN(3)}
	for _, m := range g.ms {
		left, acts := m.Grant(g.now, b)
		if left > b.FreePages {
			return fmt.Errorf("grant left %d of %d pages", left, b.FreePages)
		}
		if err := g.exec(m, acts); err != nil {
			return err
		}
	}
	// The scheduler: cut rooms finish; others make progress or finish.
	for _, id := range g.sortedSched() {
		cut := g.sched[id]
		produced := !cut && g.rng.IntN(3) == 0
		if !cut && !produced {
			if g.rng.IntN(3) == 0 {
				for _, m := range g.ms {
					if err := g.exec(m, m.Sent(id, 1+g.rng.IntN(8), nil)); err != nil {
						return err
					}
				}
			}
			continue
		}
		if produced {
			for _, m := range g.ms {
				if err := g.exec(m, m.Sent(id, 100, &pdproto.ChunkFinal{FirstToken: 1})); err != nil {
					return err
				}
			}
		}
		g.log("sched-finished %d produced=%v", id, produced)
		delete(g.sched, id)
		for r, m := range g.ms {
			acts, handled := m.SchedFinished(g.now, id, produced, "abort")
			if !handled {
				g.ends[r][id]++ // the caller ends it by the scheduler's reason
			}
			if err := g.exec(m, acts); err != nil {
				return err
			}
		}
	}
	return nil
}

func (g *group) sortedSched() []uint64 {
	var ids []uint64
	for id := range g.sched {
		ids = append(ids, id)
	}
	for i := range ids {
		for j := i + 1; j < len(ids); j++ {
			if ids[j] < ids[i] {
				ids[i], ids[j] = ids[j], ids[i]
			}
		}
	}
	return ids
}

// exec acts as the serve loop does on the actions of rank m.
func (g *group) exec(m *Machine, acts []Action) error {
	for _, a := range acts {
		r := m.cfg.Rank
		switch a := a.(type) {
		case End:
			g.ends[r][a.ID]++
		case Admit:
			g.joined[r][a.ID] = true
			if m.cfg.Rank == 0 {
				g.sched[a.ID] = false
			}
		case Cut:
			if m.cfg.Rank == 0 {
				g.sched[a.ID] = true
			}
		case Reserve:
			g.held[a.ID]++
		case Release:
			if g.held[a.ID]--; g.held[a.ID] < 0 {
				return fmt.Errorf("request %d released more than reserved", a.ID)
			}
		case Arrived:
			g.held[a.ID]--
			g.ends[r][a.ID]++
		case Forget:
			if m.cfg.Rank == 0 {
				delete(g.admit, a.ID)
			}
		case SendChunk:
			if !g.joined[r][a.ID] {
				return fmt.Errorf("rank %d: a chunk of request %d before it joined the scheduler", r, a.ID)
			}
			if g.rng.IntN(25) == 0 {
				m.SendFailed(a.ID, "KV", errors.New("timeout"))
			}
		case SendTransferInfo:
			if g.rng.IntN(25) == 0 {
				m.SendFailed(a.ID, "transfer info", errors.New("timeout"))
			}
		}
	}
	return nil
}

func (g *group) checkAgree() error {
	h := &harness{ms: g.ms}
	return h.agree()
}

// FuzzTrace runs the trace language on arbitrary input: whatever the
// commands, the machines must never break an invariant, panic or let the
// ranks disagree (a harness error for a malformed command is fine).
func FuzzTrace(f *testing.F) {
	f.Add("config role=decode ranks=2\nadmit id=1 prompt=8 max=4 url=http://p t=0\nresolve id=1\npoll t=0\ngrant t=0 free=16 rows=4\nabort id=1 t=1\npoll t=9")
	f.Add("config role=prefill ranks=2\nadmit id=1 prompt=8 t=0\nmail id=1 info tokens=8\npoll t=1\nsent id=1 end=8 first=4\nsched-finished id=1 produced=true t=1\nmail id=1 rank=1 abort\npoll t=2")
	f.Fuzz(func(t *testing.T, script string) {
		h := &harness{}
		for line := range strings.SplitSeq(script, "\n") {
			if _, err := h.run(line); err != nil && strings.Contains(err.Error(), "invariant") {
				t.Fatalf("%s: %v", line, err)
			}
		}
	})
}
