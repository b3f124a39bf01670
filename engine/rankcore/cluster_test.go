package rankcore

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/mailbox"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/internal/tracetest"
)

// A PD cluster in one goroutine: a prefill group and a decode group of
// the group harness (group_test.go), each rank with its own rooms machine
// (engine/pd/rooms) and mailbox machine (engine/pd/mailbox), and a wire
// between them that carries the PD protocol's messages. A cluster step
// runs one iteration of the prefill group, delivers what it sent, runs
// one iteration of the decode group and delivers what that sent; each
// delivery is filed by the receiving rank's mailbox, whose answers (an
// ABORT_ACK for a room it does not have) go back at once. Rank r of one
// side pairs with rank r of the other. The KV is counted, not copied: a
// chunk names its tokens.

// pdSide is a rank's PD side: its machines, its requests by id, and the
// wire it sends on.
type pdSide struct {
	g        *groupRank
	role     rooms.Role
	machine  *rooms.Machine
	mb       *mailbox.Machine
	endpoint string
	peer     string // the other side's rank of the same number
	reqs     map[uint64]groupAdd
	wire     *wire
	silent   *time.Duration // set: the peer answers no heartbeat since then
	lookups  bool           // the prefill's registry answers (decode)
	refuse   string         // set: the registry refuses the handshake, saying so
}

// envelope is one message on the wire.
type envelope struct {
	from, to string
	msg      pdproto.Message
}

// wire carries messages between the sides, in the order they were sent;
// held messages wait for release (a slow link).
type wire struct {
	queue []envelope
	hold  bool
	drop  string // messages of this type are lost (a broken link for them)
}

func (w *wire) post(from, to string, m pdproto.Message) {
	w.queue = append(w.queue, envelope{from: from, to: to, msg: m})
}

func (pd *pdSide) rooms() int {
	if pd == nil {
		return 0
	}
	return pd.machine.Len()
}

// admit takes a PD request of the step input into the machine and the
// mailbox.
func (pd *pdSide) admit(now time.Duration, a groupAdd) {
	r := rooms.Request{ID: a.id, Room: a.room, PromptLen: a.req.PromptLen, MaxTokens: a.req.MaxTokens, Prompt: fingerprint(a.seq.Tokens)}
	if pd.role == rooms.Decode {
		r.URL = "http://prefill"
	}
	if err := pd.machine.Admit(now, r); err != nil {
		pd.g.err = err
		return
	}
	pd.reqs[a.id] = a
	pd.mb.Admit(a.room)
}

func fingerprint(prompt []int32) pdproto.Fingerprint { return pdproto.PromptFingerprint(prompt) }

// observe files each room's mail, resolves the decode's registry lookups
// (the prefill is always found) and tells the machine of its peer.
func (pd *pdSide) observe(now time.Duration) {
	for _, id := range slicesSorted(pd.reqs) {
		if m := pd.mb.Take(pd.reqs[id].room); !m.Empty() {
			pd.exec(now, pd.machine.File(now, id, m))
		}
	}
	for _, r := range pd.machine.Resolving() {
		switch {
		case pd.refuse != "":
			pd.machine.Resolve(r.ID, rooms.Resolution{Err: errors.New(pd.refuse)})
		case pd.lookups:
			pd.machine.Resolve(r.ID, rooms.Resolution{Endpoint: pd.peer})
		}
	}
	for _, p := range pd.machine.Peers() {
		l := rooms.Liveness{Boot: 1}
		if pd.silent != nil {
			l.Silent = now - *pd.silent
		}
		pd.machine.Peer(p, l)
	}
}

func slicesSorted(m map[uint64]groupAdd) []uint64 {
	ids := make([]uint64, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// applyPoll moves the rooms by the agreed votes; the prefill requests the
// ranks agreed to admit join the scheduler in this iteration.
func (pd *pdSide) applyPoll(now time.Duration, agreed []int64) []groupAdd {
	acts, err := pd.machine.Apply(now, agreed)
	if err != nil {
		pd.g.err = err
		return nil
	}
	var joins []groupAdd
	for _, a := range acts {
		if ad, ok := a.(rooms.Admit); ok {
			pd.g.pdActs = append(pd.g.pdActs, rooms.Format(a)+" to the scheduler")
			joins = append(joins, pd.reqs[ad.ID])
			continue
		}
		pd.exec(now, []rooms.Action{a})
	}
	return joins
}

// grant gives the decode's rooms that wait for memory their pages within
// the agreed room, and returns what is left to the scheduler.
func (pd *pdSide) grant(now time.Duration, room Capacity) int {
	if pd.role != rooms.Decode {
		return room.Pages
	}
	core := pd.g.core
	free, acts := pd.machine.Grant(now, rooms.Budget{FreePages: room.Pages, FreeRows: room.Rows, SchedSlots: core.FreeSlots(), SchedGrowth: core.Reserve(0)})
	pd.exec(now, acts)
	return free
}

// sendStepKV sends, after a prefill step, each PD request's new tokens to
// its decode, the chunk that sampled carrying the first token.
func (pd *pdSide) sendStepKV(plan sched.Plan, toks map[uint64]int32) {
	if pd == nil || pd.role != rooms.Prefill {
		return
	}
	for _, it := range plan.Run {
		a, ok := pd.reqs[it.ID]
		if s := pd.g.core.Seq(it.ID); !ok || s == nil || s.Cut {
			continue
		}
		var final *pdproto.ChunkFinal
		if tok, ok := toks[it.ID]; ok {
			final = &pdproto.ChunkFinal{FirstToken: tok, PromptTokens: uint32(a.req.PromptLen), CachedTokens: uint32(it.Cached)}
		}
		pd.exec(pd.g.core.Now(), pd.machine.Sent(it.ID, it.Start+it.Tokens, final))
	}
}

// schedFinished tells the machine of a prefill request the scheduler
// finished: true when the machine owns its end.
func (pd *pdSide) schedFinished(now time.Duration, f sched.Finish) bool {
	if pd == nil || !pd.machine.Has(f.ID) {
		return false
	}
	produced := f.Reason == sched.ReasonStop || f.Reason == sched.ReasonLength
	acts, handled := pd.machine.SchedFinished(now, f.ID, produced, f.Reason.String())
	pd.exec(now, acts)
	return handled
}

// abort aborts a PD request outside the scheduler.
func (pd *pdSide) abort(now time.Duration, id uint64, why string) {
	if pd == nil || !pd.machine.Has(id) {
		return
	}
	if a, ok := pd.reqs[id]; ok {
		if m := pd.mb.Take(a.room); !m.Empty() {
			pd.exec(now, pd.machine.File(now, id, m))
		}
	}
	acts, _ := pd.machine.Abort(now, id, why)
	pd.exec(now, acts)
}

// exec carries out the machine's actions: what a page costs is counted in
// the rank's pool, what goes to the peer goes on the wire.
func (pd *pdSide) exec(now time.Duration, acts []rooms.Action) {
	g := pd.g
	page := g.core.sched.Config().PageSize
	for _, act := range acts {
		switch act.(type) {
		case rooms.SendTransferInfo, rooms.SendChunk, rooms.SendQueued, rooms.SendStatus, rooms.SendAbort, rooms.SendAbortAck:
			// On the wire, which prints it.
		default:
			g.pdActs = append(g.pdActs, rooms.Format(act))
		}
		switch a := act.(type) {
		case rooms.Reserve:
			g.held[a.ID] = (a.Tokens + page - 1) / page
		case rooms.SendTransferInfo:
			q := pd.reqs[a.ID]
			pd.wire.post(pd.endpoint, a.Peer, &pdproto.TransferInfo{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(g.r),
				Tokens: uint32(a.Tokens), Prompt: fingerprint(q.seq.Tokens), IndexKDType: "fp8", RequestID: fmt.Sprint(a.ID)})
		case rooms.SendChunk:
			q := pd.reqs[a.ID]
			pd.wire.post(pd.endpoint, a.Peer, &pdproto.KVChunk{Room: a.Room, Chunk: uint32(a.Index), Start: uint32(a.Start), End: uint32(a.End),
				Prompt: fingerprint(q.seq.Tokens), Final: a.Final})
		case rooms.SendQueued:
			pd.wire.post(pd.endpoint, a.Peer, &pdproto.Queued{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(g.r), Position: uint32(a.Position)})
		case rooms.SendStatus:
			pd.wire.post(pd.endpoint, a.Peer, &pdproto.Status{Room: a.Room, Rank: uint32(g.r), State: a.State, Error: a.Error, Asked: a.Asked})
		case rooms.SendAbort:
			pd.wire.post(pd.endpoint, a.Peer, &pdproto.Abort{Room: a.Room, Endpoint: pd.endpoint, Rank: uint32(g.r), Reason: a.Reason, Asked: a.Asked})
		case rooms.SendAbortAck:
			pd.wire.post(pd.endpoint, a.To, &pdproto.AbortAck{Room: a.Room, Rank: uint32(g.r), Known: true})
		case rooms.ApplyChunk:
			// The KV lands in the reserved pages: counted already.
		case rooms.Cut:
			g.cut(a.ID, a.Reason.Text)
		case rooms.Arrived:
			pd.arrived(a)
		case rooms.Release:
			delete(g.held, a.ID)
		case rooms.End:
			o := a.Outcome
			switch {
			case o.OK:
				g.endAs(a.ID, "length")
			case o.Reason.Kind == rooms.KindAborted || o.Reason.Asked:
				g.endAs(a.ID, "abort")
			default:
				g.endAs(a.ID, "error: pd: "+o.Reason.Kind.String())
			}
		case rooms.Forget:
			delete(pd.reqs, a.ID)
			if to, ack := pd.mb.Forget(a.Room, a.Why, a.Asked); ack != nil {
				pd.wire.post(pd.endpoint, to, ack)
			}
		}
	}
}

// arrived takes a decode request on once its prompt's KV is in: it joins
// the scheduler at the prompt's length with the prefill's first token, or
// ends at that token.
func (pd *pdSide) arrived(a rooms.Arrived) {
	g, q := pd.g, pd.reqs[a.ID]
	tok := a.First.FirstToken
	st := q.seq
	st.Tokens = append(slices.Clone(st.Tokens), tok)
	st.Decoding = true
	if g.core.StopsAt(q.seq, tok) || q.seq.MaxTokens == 1 {
		g.endAs(a.ID, "stop at the first token")
		delete(g.held, a.ID)
		return
	}
	n := len(q.seq.Tokens)
	if err := g.core.Join(sched.Request{ID: a.ID, PromptLen: n + 1, MaxTokens: q.seq.MaxTokens - 1, Transferred: n}, st); err != nil {
		g.endAs(a.ID, "error")
		delete(g.held, a.ID)
	}
}

// cluster is the harness: the two groups and the wire between them.
type cluster struct {
	sides  [2]*group // prefill, decode
	wire   *wire
	now    time.Duration
	broken bool
}

var sideNames = [2]string{"prefill", "decode"}

func newCluster(args map[string]string) (*cluster, error) {
	c := &cluster{wire: &wire{}}
	timeout := func(k string, def time.Duration) time.Duration {
		if v := args[k]; v != "" {
			return time.Duration(atoi(v, 0)) * time.Millisecond
		}
		return def
	}
	for i, role := range []rooms.Role{rooms.Prefill, rooms.Decode} {
		a := map[string]string{}
		for k, v := range args {
			a[k] = v
		}
		if p := args[sideNames[i]+"-pages"]; p != "" {
			a["pages"] = p
		}
		gr, err := newGroup(a)
		if err != nil {
			return nil, err
		}
		for _, g := range gr.ranks {
			m, err := rooms.New(rooms.Config{Role: role, Rank: g.r, PageSize: atoi(args["page"], 4), IndexKDType: "fp8",
				BootstrapTimeout: timeout("bootstrap", time.Second), TransferTimeout: timeout("transfer", time.Second),
				InflightTimeout: timeout("inflight", time.Second), AbortAckTimeout: timeout("ack", time.Second),
				HeartbeatTimeout: timeout("heartbeat", time.Second), QueuedInterval: min(timeout("queued", 200*time.Millisecond), timeout("bootstrap", time.Second)/2),
				ReservedDecodeTokens: -1})
			if err != nil {
				return nil, err
			}
			self, peer := fmt.Sprintf("tcp://%s/r%d", sideNames[i], g.r), fmt.Sprintf("tcp://%s/r%d", sideNames[1-i], g.r)
			mb, err := mailbox.New(mailbox.Config{Role: role, Rank: g.r, Sender: self, Boot: 1})
			if err != nil {
				return nil, err
			}
			g.pd = &pdSide{g: g, role: role, machine: m, mb: mb, endpoint: self, peer: peer, reqs: map[uint64]groupAdd{}, wire: c.wire, lookups: true}
		}
		c.sides[i] = gr
	}
	return c, nil
}

// rank is the rank whose endpoint is to.
func (c *cluster) rank(to string) *groupRank {
	for _, gr := range c.sides {
		for _, g := range gr.ranks {
			if g.pd.endpoint == to {
				return g
			}
		}
	}
	return nil
}

// deliver files every message on the wire at its rank's mailbox, printing
// each once for all the ranks that sent the same; an answer the mailbox
// gives goes on the wire for the next delivery.
func (c *cluster) deliver(b *strings.Builder) {
	if c.wire.hold {
		if n := len(c.wire.queue); n > 0 {
			fmt.Fprintf(b, "wire: %d messages held\n", n)
		}
		return
	}
	q := c.wire.queue
	c.wire.queue = nil
	var lines []string
	counts := map[string]int{}
	for _, e := range q {
		line := fmt.Sprintf("%s → %s: %s", side(e.from), side(e.to), describe(e.msg))
		g := c.rank(e.to)
		switch {
		case c.wire.drop != "" && strings.HasPrefix(describe(e.msg), c.wire.drop):
			line += " (lost)"
		case g == nil:
			line += " (no such rank)"
		default:
			d := g.pd.mb.File(time.Unix(0, int64(c.now)), e.msg)
			if d.Drop != mailbox.Kept {
				line += " (" + d.Drop.String() + ")"
			}
			if d.Answer != nil {
				line += ", answered at once: " + describe(d.Answer)
				c.wire.post(e.to, d.To, d.Answer)
			}
		}
		if counts[line] == 0 {
			lines = append(lines, line)
		}
		counts[line]++
	}
	for i, l := range lines {
		if n := counts[l]; n > 1 {
			lines[i] = fmt.Sprintf("%s (×%d)", l, n)
		}
	}
	for _, l := range runs(lines) {
		fmt.Fprintf(b, "wire: %s\n", l)
	}
}

// side names an endpoint's side, without its rank.
func side(endpoint string) string {
	s := strings.TrimPrefix(endpoint, "tcp://")
	if i := strings.IndexByte(s, '/'); i >= 0 {
		s = s[:i]
	}
	return s
}

// describe prints a protocol message briefly.
func describe(m pdproto.Message) string {
	switch m := m.(type) {
	case *pdproto.TransferInfo:
		return fmt.Sprintf("transfer-info room=%d tokens=%d", m.Room, m.Tokens)
	case *pdproto.KVChunk:
		s := fmt.Sprintf("kv-chunk room=%d [%d,%d)", m.Room, m.Start, m.End)
		if m.Final != nil {
			s += fmt.Sprintf(" first=%d", m.Final.FirstToken)
		}
		return s
	case *pdproto.Status:
		s := fmt.Sprintf("status room=%d %v", m.Room, m.State)
		if m.Error != "" {
			s += fmt.Sprintf(" %q", m.Error)
		}
		if m.Asked {
			s += " (asked)"
		}
		return s
	case *pdproto.Abort:
		s := fmt.Sprintf("abort room=%d %q", m.Room, m.Reason)
		if m.Asked {
			s += " (asked)"
		}
		return s
	case *pdproto.AbortAck:
		return fmt.Sprintf("abort-ack room=%d known=%v", m.Room, m.Known)
	case *pdproto.Queued:
		return fmt.Sprintf("queued room=%d position=%d", m.Room, m.Position)
	}
	return fmt.Sprintf("%T", m)
}

// step runs one cluster step: the prefill's iteration and the decode's,
// each followed by a delivery.
func (c *cluster) step(b *strings.Builder) {
	for i, gr := range c.sides {
		var sb strings.Builder
		gr.now = c.now
		gr.iterate(&sb)
		c.broken = c.broken || gr.broken
		for l := range strings.SplitSeq(strings.TrimRight(sb.String(), "\n"), "\n") {
			if l != "" {
				fmt.Fprintf(b, "%s %s\n", sideNames[i], l)
			}
		}
		c.deliver(b)
	}
	c.now += time.Millisecond
}

// TestClusterTraces runs testdata/cluster-*.txt: a PD request's life and
// its failures through a prefill and a decode group of the loop, in one
// goroutine. Commands:
//
//	cluster [ranks=N] [page=S] [pages=P] [prefill-pages=P] [decode-pages=P] [loop=overlap]
//	        [bootstrap=MS] [transfer=MS] [inflight=MS] [ack=MS] [heartbeat=MS] [request-timeout=MS] [chunk=C]
//	request id=ID room=R prompt=LEN max=M [n=K] [side=prefill|decode]   the router's request (K of them: ids and rooms
//	                               counting up), to both sides (or one)
//	abort side=S id=ID [n=K] [by=WHO]    the client's abort (or WHO's: operator), in the side's next input
//	registry on|off|refuses        the prefill's registry answers the decode's lookups (on), never, or refuses the handshake
//	sample side=S id=ID toks=T,T   that side's rank 0's next tokens for ID
//	wire hold|release|drop=TYPE|deliver    the link between the sides
//	silence                        the prefill answers the decode's heartbeats no more
//	wait ms=N                      the clock moves N ms
//	local side=S rank=R idle       at its next iteration the rank goes idle on its own view
//	step [n=K]                     K cluster steps (1)
//	state side=S [rank=R]          what the rank's core and machine hold
func TestClusterTraces(t *testing.T) {
	tracetest.Run(t, "testdata/cluster-*.txt", func(t *testing.T) func(string) string {
		var c *cluster
		return func(line string) string {
			f := strings.Fields(line)
			args := kv(f[1:])
			if f[0] != "cluster" && c == nil {
				return "no cluster yet\n"
			}
			sides := []int{0, 1}
			switch args["side"] {
			case "prefill":
				sides = []int{0}
			case "decode":
				sides = []int{1}
			}
			switch f[0] {
			case "cluster":
				var err error
				if c, err = newCluster(args); err != nil {
					return err.Error() + "\n"
				}
				return fmt.Sprintf("prefill and decode, %d ranks each\n", len(c.sides[0].ranks))
			case "request":
				first, room0, plen, max := uint64(atoi(args["id"], 0)), uint64(atoi(args["room"], 0)), atoi(args["prompt"], 1), atoi(args["max"], 1)
				prompt := make([]int32, plen)
				for i := range prompt {
					prompt[i] = int32(100 + i)
				}
				for k := range uint64(atoi(args["n"], 1)) {
					id, room := first+k, room0+k
					for _, i := range sides {
						m := max
						if i == 0 {
							m = 1 // the prefill samples the first token only
						}
						c.sides[i].next.adds = append(c.sides[i].next.adds, groupAdd{id: id, n: 1, room: room,
							req: sched.Request{ID: id, PromptLen: plen, MaxTokens: m}, seq: Seq{Tokens: prompt, MaxTokens: m, IgnoreEOS: true}})
					}
				}
				return "queued\n"
			case "abort":
				first := uint64(atoi(args["id"], 0))
				for k := range uint64(atoi(args["n"], 1)) {
					id := first + k
					for _, i := range sides {
						in := &c.sides[i].next
						in.aborts = append(in.aborts, id)
						if by := args["by"]; by != "" {
							if in.why == nil {
								in.why = map[uint64]string{}
							}
							in.why[id] = "aborted by the " + by
							if by == "operator" {
								in.why[id] = "aborted by an operator"
							}
						}
					}
				}
				return "queued\n"
			case "registry":
				for _, g := range c.sides[1].ranks {
					g.pd.lookups = len(f) > 1 && f[1] == "on"
					if len(f) > 1 && f[1] == "refuses" {
						g.pd.refuse = "pd handshake refused: prefill rank 0 has page_size 8, decode has 4: page_size must match"
					}
				}
				return "ok\n"
			case "sample":
				for _, i := range sides {
					id := uint64(atoi(args["id"], 0))
					c.sides[i].samples[id] = append(c.sides[i].samples[id], tokens(args["toks"])...)
				}
				return "queued\n"
			case "wire":
				var b strings.Builder
				switch {
				case len(f) > 1 && f[1] == "hold":
					c.wire.hold = true
				case len(f) > 1 && f[1] == "release":
					c.wire.hold = false
				case len(f) > 1 && f[1] == "deliver":
					c.deliver(&b)
				default:
					c.wire.drop = args["drop"]
				}
				return b.String() + "ok\n"
			case "silence":
				at := c.now
				for _, g := range c.sides[1].ranks {
					g.pd.silent = &at
				}
				return "the prefill is silent\n"
			case "wait":
				c.now += time.Duration(atoi(args["ms"], 0)) * time.Millisecond
				return fmt.Sprintf("now %v\n", c.now)
			case "local":
				c.sides[sides[0]].ranks[atoi(args["rank"], 0)].idle = true
				return "armed\n"
			case "step":
				var b strings.Builder
				for i := range atoi(args["n"], 1) {
					if c.broken {
						b.WriteString("a group is broken\n")
						break
					}
					if atoi(args["n"], 1) > 1 {
						fmt.Fprintf(&b, "-- step %d\n", i+1)
					}
					c.step(&b)
				}
				return b.String()
			case "state":
				g := c.sides[sides[0]].ranks[atoi(args["rank"], 0)]
				var b strings.Builder
				b.WriteString(g.state())
				for _, e := range g.pd.machine.Entries() {
					fmt.Fprintf(&b, "room %d: %+v\n", e.Room, e)
				}
				return b.String()
			}
			return fmt.Sprintf("unknown command %q\n", f[0])
		}
	})
}
