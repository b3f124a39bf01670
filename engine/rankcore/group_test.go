package rankcore

import (
	"fmt"
	"iter"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/engine/sched"
	"github.com/pdkit/pdkit/internal/tracetest"
)

// A group of ranks in one goroutine: each rank is a Core with its own
// cursor through the lock-step table and a pool counted in pages; its
// iteration is a coroutine that stops at every collective, and the
// harness runs a collective once every rank has reached it, reducing the
// proposals or broadcasting rank 0's value as the phase says. Ranks that
// reach different phases (or one that ends its iteration while another
// waits) are a broken group: the harness names each rank's phase, as the
// collective layer does, and CheckLog names the seq over their logs.
//
// The rank program is the lock-step loop of a colocated server without a
// prefix cache: input (rank 0's requests, aborts and clock), the
// scheduler's timeouts, room, agree, the forward pass, results (rank 0's
// tokens, with Stops), the forks of first tokens. What costs pages is
// counted, not run: a plan's item holds its Pages from the step on, a
// finish or a retraction gives them back.

// call is one rank's side of a collective.
type call struct {
	phase Phase
	ints  []int64 // a reduction's proposal; the agreed value once run
	msg   any     // a broadcast: rank 0's value; everyone's once run
}

// groupInput is rank 0's step input.
type groupInput struct {
	now     time.Duration
	adds    []groupAdd
	aborts  []uint64
	why     map[uint64]string // who asked for an abort, when not the client
	switch_ bool              // the index-K switch goes in
}

type groupAdd struct {
	id   uint64
	n    int
	req  sched.Request
	seq  Seq
	room uint64 // a PD request's bootstrap room (cluster harness); 0: colocated
}

// groupResults is rank 0's broadcast after the forward pass.
type groupResults struct {
	now  time.Duration
	cuts []uint64
	toks []Sampled
}

// groupRank is one rank: its core, cursor, pool and log.
type groupRank struct {
	r     int
	core  *Core
	cur   *Cursor
	pages int            // the pool's pages
	held  map[uint64]int // pages each live sequence holds
	rows  int            // sequence rows
	log   []Entry
	ends  []string // this iteration's ends, "id reason"
	idle  bool     // the fault: at its next iteration it goes idle on its own view
	forks []string // this iteration's fork decisions
	err   error
	// plans are the plans it proposed in this iteration; flight is the
	// overlap loop's step in flight; yield hands a collective to the
	// harness.
	plans  []sched.Plan
	flight *sched.Plan
	voided []uint64 // the plan made ahead's items the landed step ended
	// prefix: the prefix cache is on; matches are this rank's own cache's
	// matches, by request (its own view: ranks may differ); admits are
	// this iteration's admission decisions.
	pd       *pdSide  // the rank's PD side on a prefill or decode (cluster_test.go); nil colocated
	pdActs   []string // this iteration's PD actions but sends
	prefix   bool
	matches  map[uint64]Match
	admits   []string
	switched int // index-K switches applied
	yield    func(*call) bool
}

func (g *groupRank) free() int {
	n := g.pages
	for _, p := range g.held {
		n -= p
	}
	return n
}

// group is the harness.
type group struct {
	ranks   []*groupRank
	now     time.Duration
	next    groupInput
	cuts    []uint64           // aborts that come during the next step
	samples map[uint64][]int32 // rank 0's tokens, per request, in order
	step    int
	broken  bool
	table   *Table
	args    map[string]string // the group command's, for a rebuild
	// drain is an index-K switch's drain in progress: the iterations it
	// has run and its bound; new requests wait (held) until it switches.
	drain *groupDrain
	held  []groupAdd
}

// groupDrain is an index-K switch waiting for the ranks to hold nothing.
type groupDrain struct{ ran, bound int }

const groupEOG = 0 // the harness's end-of-generation token

func newGroup(args map[string]string) (*group, error) {
	n, pages, page, rows := atoi(args["ranks"], 2), atoi(args["pages"], 16), atoi(args["page"], 4), atoi(args["rows"], 8)
	cfg := sched.Config{MaxRunning: atoi(args["running"], 4), MaxBatchTokens: atoi(args["batch"], 64),
		PrefillChunk: atoi(args["chunk"], 64), PageSize: page, TotalPages: pages,
		RequestTimeout: time.Duration(atoi(args["request-timeout"], 0)) * time.Millisecond}
	t := &Lockstep
	if args["loop"] == "overlap" {
		t, cfg.Overlap = &Overlap, true
	}
	g := &group{samples: map[uint64][]int32{}, table: t, args: args}
	_, prefix := args["cache"]
	for r := range n {
		c, err := NewCore(cfg, func(t int32) bool { return t == groupEOG })
		if err != nil {
			return nil, err
		}
		g.ranks = append(g.ranks, &groupRank{r: r, core: c, cur: NewCursor(t), pages: pages, held: map[uint64]int{}, rows: rows,
			prefix: prefix, matches: map[uint64]Match{}})
	}
	return g, nil
}

func atoi(s string, def int) int {
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		panic(fmt.Sprintf("bad number %q", s))
	}
	return n
}

// iterate is rank g's iteration as a coroutine: every collective is
// yielded, and the agreed value read back once the harness resumes it.
func (g *groupRank) iterate(in *groupInput, env *stepEnv, yield func(*call) bool) {
	g.yield = yield
	g.ends, g.forks, g.plans, g.voided, g.admits, g.pdActs = g.ends[:0], g.forks[:0], g.plans[:0], nil, nil, nil
	plan, ok := g.front(in)
	if !ok {
		return
	}
	if g.cur.Table() == &Overlap {
		g.overlapBack(plan, env)
		return
	}
	g.finish(plan.Finished)
	g.retract(plan)
	if !g.cur.Runs(Forward, Facts{Batch: len(plan.Run)}) || !g.forward(plan) {
		return
	}
	c := &call{}
	if g.r == 0 {
		c.msg = &groupResults{now: env.now, cuts: env.cuts, toks: g.sampled(plan, env)}
	}
	if !g.coll(Results, c) {
		return
	}
	g.land(plan, c.msg.(*groupResults), false)
}

// coll runs collective p with c: the cursor enters p, the log records it,
// and the harness runs it once every rank is there. False: the iteration
// ends (the cursor refused, or the harness stopped the rank).
func (g *groupRank) coll(p Phase, c *call) bool {
	if err := g.cur.Enter(p); err != nil {
		g.err = err
		return false
	}
	c.phase = p
	g.log = append(g.log, Entry{Seq: uint64(len(g.log) + 1), Op: p.Op(), Tag: p.String()})
	return g.yield(c)
}

// room proposes the rank's free pages and rows in phase p.
func (g *groupRank) room(p Phase) (Capacity, bool) {
	c := &call{ints: []int64{int64(g.free()), int64(g.rows - len(g.held))}}
	if !g.coll(p, c) {
		return Capacity{}, false
	}
	return Capacity{Pages: int(c.ints[0]), Rows: int(c.ints[1])}, true
}

// front is the iteration up to its agreed plan: the input applied, the
// requests joined, the room and the plan agreed. False: the iteration
// ends there (nothing to run, or the group broke).
func (g *groupRank) front(in *groupInput) (sched.Plan, bool) {
	c := &call{}
	if g.r == 0 {
		c.msg = in
	}
	if !g.coll(Input, c) {
		return sched.Plan{}, false
	}
	input := c.msg.(*groupInput)
	core := g.core
	core.Begin(input.now)
	if input.switch_ {
		g.switched++ // the pool's index keys change precision: nothing holds any
	}
	var joining []groupAdd
	for _, a := range input.adds {
		core.Expect(a.id, a.n)
		switch {
		case a.room != 0 && g.pd != nil:
			g.pd.admit(input.now, a)
		case slices.Contains(input.aborts, a.id):
			g.end(a.id, sched.ReasonAbort)
		default:
			joining = append(joining, a)
		}
	}
	for _, id := range input.aborts {
		why := "aborted by the client"
		if w, ok := input.why[id]; ok {
			why = w
		}
		g.cut(id, why)
	}
	g.finish(core.Tick())
	if g.pd.rooms() > 0 {
		g.pd.observe(input.now)
	}
	if g.idle {
		// The fault: a branch on this rank's own view before a
		// collective, the one rule the table exists to keep.
		g.idle = false
		return sched.Plan{}, false
	}
	if !g.cur.Runs(Room, Facts{Joining: len(joining), Scheduled: core.Scheduled(), Rooms: g.pd.rooms()}) {
		return sched.Plan{}, false
	}
	if g.cur.Runs(Poll, Facts{Rooms: g.pd.rooms()}) {
		c := &call{ints: g.pd.machine.Votes(input.now)}
		if !g.coll(Poll, c) {
			return sched.Plan{}, false
		}
		joining = append(joining, g.pd.applyPoll(input.now, c.ints)...)
	}
	var admits []Admission
	if g.cur.Runs(Admit, Facts{Joining: len(joining), PrefixOn: g.prefix}) {
		own := make([]Match, len(joining))
		for i, a := range joining {
			own[i] = g.matches[a.id]
		}
		c := &call{ints: AdmitProposal(own)}
		if !g.coll(Admit, c) {
			return sched.Plan{}, false
		}
		admits = PlanAdmit(own, c.ints)
	}
	for i, a := range joining {
		req := a.req
		if admits != nil {
			d := admits[i]
			req.Cached, req.Loaded = d.Agreed.Total, d.Loaded()
			g.admits = append(g.admits, fmt.Sprintf("%d: %s", a.id, d))
		}
		if err := core.Join(req, a.seq); err != nil {
			g.end(a.id, sched.ReasonError)
		}
	}
	room, ok := g.room(Room)
	if ok && g.pd != nil {
		room.Pages = g.pd.grant(input.now, room)
	}
	if !ok || !g.cur.Runs(Agree, Facts{Scheduled: core.Scheduled()}) {
		return sched.Plan{}, false
	}
	return g.plan(room)
}

// plan schedules within the agreed room and agrees on the plan.
func (g *groupRank) plan(room Capacity) (sched.Plan, bool) {
	plan, err := g.core.Schedule(room)
	if err != nil {
		g.err = err
		return sched.Plan{}, false
	}
	g.plans = append(g.plans, plan)
	c := &call{ints: AgreeProposal(PlanDigest(0, plan.Run))}
	if !g.coll(Agree, c) {
		return sched.Plan{}, false
	}
	if !PlansAgree(c.ints) {
		g.err = fmt.Errorf("rank %d: the ranks planned different steps", g.r)
		return sched.Plan{}, false
	}
	return plan, true
}

// retract gives the plan's retracted requests' pages back.
func (g *groupRank) retract(plan sched.Plan) {
	g.core.Retracted(plan)
	for _, rt := range plan.Retract {
		delete(g.held, rt.ID)
	}
}

// forward enters the forward pass: the batch's items hold their pages.
func (g *groupRank) forward(plan sched.Plan) bool {
	if err := g.cur.Enter(Forward); err != nil {
		g.err = err
		return false
	}
	for _, it := range plan.Run {
		g.held[it.ID] = it.Pages
	}
	return true
}

// land applies a step's results: the cuts, the tokens (appended already
// in the overlap loop), the forks of first tokens, the scheduler's
// finishes.
func (g *groupRank) land(plan sched.Plan, res *groupResults, appended bool) {
	core := g.core
	core.Later(res.now)
	for _, id := range res.cuts {
		g.cut(id, "aborted by the client")
	}
	landFn := core.Land
	if appended {
		landFn = core.LandAppended
	}
	ld, err := landFn(plan, res.toks)
	if err != nil {
		g.err = err
		return
	}
	if g.cur.Runs(Fork, Facts{Firsts: len(ld.Forks)}) {
		room, ok := g.room(Fork)
		if !ok {
			return
		}
		fp := PlanFirstForks(room, core.sched.Config().PageSize, core.Firsts(ld.Forks))
		for _, d := range fp.Samples {
			g.forks = append(g.forks, d.String())
			if d.Act == ActEnd {
				g.end(d.ID, d.End)
				continue
			}
			req, st := core.ForkJoin(d, ld.Forks)
			if err := core.Join(req, st); err != nil {
				g.end(d.ID, sched.ReasonError)
				continue
			}
			if d.Act == ActFork {
				g.held[d.ID] = d.Pages
			}
		}
	}
	g.pd.sendStepKV(plan, ld.Tokens)
	fs, err := core.StepDone(ld.Outcomes)
	g.finish(fs)
	if err != nil {
		g.err = err
	}
}

// overlapBack is the overlap loop's rest of an iteration from its agreed
// plan, planned while the step before was in flight: that step lands
// (results, its tokens appended), what stopped or was cut in it leaves
// this plan, an emptied plan is planned again once it has ended, and this
// step flies while the landed one ends.
func (g *groupRank) overlapBack(plan sched.Plan, env *stepEnv) {
	var landed *groupResults
	var flown sched.Plan
	if g.flight != nil {
		flown, g.flight = *g.flight, nil
		c := &call{}
		if g.r == 0 {
			c.msg = &groupResults{now: env.now, cuts: env.cuts, toks: g.sampled(flown, env)}
		}
		if !g.coll(Results, c) {
			return
		}
		landed = c.msg.(*groupResults)
		stopped, err := g.core.Append(flown, landed.toks, landed.cuts)
		if err != nil {
			g.err = err
			return
		}
		voided := append(slices.Clone(landed.cuts), stopped...)
		g.voided = slices.DeleteFunc(slices.Clone(voided), func(id uint64) bool {
			return !slices.ContainsFunc(plan.Run, func(it sched.Item) bool { return it.ID == id })
		})
		plan = DropVoided(plan, voided)
		if len(plan.Run) == 0 {
			g.land(flown, landed, true)
			landed = nil
			if g.cur.Runs(Room, Facts{Replan: true, Scheduled: g.core.Scheduled()}) {
				room, ok := g.room(Room)
				if !ok {
					return
				}
				if plan, ok = g.plan(room); !ok {
					return
				}
			}
		}
	}
	g.finish(plan.Finished)
	g.retract(plan)
	if !g.cur.Runs(Forward, Facts{Batch: len(plan.Run)}) {
		if landed != nil {
			g.land(flown, landed, true)
		}
		return
	}
	if !g.forward(plan) {
		return
	}
	g.flight = &plan
	if landed != nil {
		g.land(flown, landed, true)
	}
}

// stepEnv is what rank 0 meets during a step: the results' clock, the
// aborts that come while the forward pass runs, and its sampler.
type stepEnv struct {
	now    time.Duration
	cuts   []uint64
	sample func(id uint64) int32
}

// sampled is rank 0's sampling: each item that wants logits and is not
// cut gets its next scripted token (7 when none is scripted), its forks
// theirs after it.
func (g *groupRank) sampled(plan sched.Plan, env *stepEnv) []Sampled {
	var out []Sampled
	for _, it := range plan.Run {
		if !it.WantLogits || g.core.Seq(it.ID).Cut || slices.Contains(env.cuts, it.ID) {
			continue
		}
		tok := env.sample(it.ID)
		out = append(out, Sampled{Tok: tok, Stop: g.core.Stops(it.ID, tok)})
		for k := range g.core.PendingForks(it.ID) {
			id := it.ID + uint64(k) + 1
			t := env.sample(id)
			out = append(out, Sampled{Tok: t, Stop: g.core.StopsAt(*g.core.Seq(it.ID), t)})
		}
	}
	return out
}

func (g *groupRank) end(id uint64, why sched.Reason) { g.endAs(id, why.String()) }

// endAs ends request id for the reason why, with its later samples.
func (g *groupRank) endAs(id uint64, why string) {
	for _, s := range g.core.End(id) {
		g.endAs(s, why)
	}
	g.ends = append(g.ends, fmt.Sprintf("%d %s", id, why))
}

// cut aborts request id for why; one the core does not know is a PD
// room's, which the PD machine aborts.
func (g *groupRank) cut(id uint64, why string) {
	c, err := g.core.Cut(id)
	switch {
	case err != nil:
		g.err = err
	case c.Unknown:
		g.pd.abort(g.core.Now(), id, why)
	default:
		g.finish(c.Finishes)
	}
}

// finish ends what the scheduler finished; a PD prefill request goes on
// in the PD machine, which ends it once the decode has its KV.
func (g *groupRank) finish(fs []sched.Finish) {
	for _, f := range fs {
		if _, err := g.core.Forget(f.ID); err != nil {
			g.err = err
			return
		}
		delete(g.held, f.ID)
		if !g.pd.schedFinished(g.core.Now(), f) {
			g.end(f.ID, f.Reason)
		}
	}
}

// iterate runs one iteration of every rank and prints the collectives as
// they run, what ended, and where the ranks parted when they did.
func (gr *group) iterate(b *strings.Builder) {
	gr.step++
	gr.now += time.Millisecond
	in := gr.next
	in.now = gr.now
	gr.next = groupInput{}
	gr.drainStep(&in, b)
	env := &stepEnv{now: gr.now + time.Millisecond/2, cuts: gr.cuts, sample: func(id uint64) int32 {
		toks := gr.samples[id]
		if len(toks) == 0 {
			return 7
		}
		gr.samples[id] = toks[1:]
		return toks[0]
	}}
	gr.cuts = nil
	pending := make([]*call, len(gr.ranks))
	nexts := make([]func() (*call, bool), len(gr.ranks))
	for i, g := range gr.ranks {
		next, stop := iter.Pull(func(yield func(*call) bool) { g.iterate(&in, env, yield) })
		defer stop()
		nexts[i] = next
	}
	advance := func() (done int) {
		for i := range nexts {
			c, ok := nexts[i]()
			pending[i] = c
			if !ok {
				done++
			}
		}
		return done
	}
	for done := advance(); done < len(gr.ranks); done = advance() {
		if done > 0 {
			// A rank that ended its iteration while a peer waits in a
			// collective goes on to its next one, and meets its peers
			// there in that iteration's first collective.
			for i, g := range gr.ranks {
				if pending[i] == nil {
					next, stop := iter.Pull(func(yield func(*call) bool) { g.iterate(&groupInput{now: in.now}, env, yield) })
					defer stop()
					nexts[i] = next
					pending[i], _ = next()
				}
			}
		}
		if where := parted(pending); where != "" {
			fmt.Fprintf(b, "broken: %s\n", where)
			var logs [][]Entry
			for _, g := range gr.ranks {
				logs = append(logs, g.log)
			}
			fmt.Fprintf(b, "check: %v\n", CheckLog(gr.table, logs))
			gr.broken = true
			return
		}
		p := pending[0].phase
		switch p.Op() {
		case dist.OpBroadcast:
			for _, c := range pending[1:] {
				c.msg = pending[0].msg
			}
		default:
			agreed := slices.Clone(pending[0].ints)
			for _, c := range pending[1:] {
				for j, v := range c.ints {
					if p.Op() == dist.OpAllReduceMin {
						agreed[j] = min(agreed[j], v)
					} else {
						agreed[j] = max(agreed[j], v)
					}
				}
			}
			for _, c := range pending {
				copy(c.ints, agreed)
			}
		}
		fmt.Fprintf(b, "%s: %s\n", p, gr.show(pending))
	}
	for _, g := range gr.ranks {
		if g.err != nil {
			fmt.Fprintf(b, "rank %d: error: %v\n", g.r, g.err)
		}
	}
	for _, g := range gr.ranks {
		for _, a := range g.admits {
			fmt.Fprintf(b, "rank %d admits %s\n", g.r, a)
		}
	}
	if a := gr.ranks[0].pdActs; len(a) > 0 {
		fmt.Fprintf(b, "pd: %s\n", strings.Join(runs(byRequest(a)), "; "))
	}
	if v := gr.ranks[0].voided; len(v) > 0 {
		fmt.Fprintf(b, "voided from the plan made ahead: %v\n", v)
	}
	if f := gr.ranks[0].forks; len(f) > 0 {
		fmt.Fprintf(b, "forks: %s\n", strings.Join(f, "; "))
	}
	if e := gr.ranks[0].ends; len(e) > 0 {
		fmt.Fprintf(b, "ended: %s\n", strings.Join(runs(e), ", "))
	}
	if d := gr.differ(); d != "" {
		fmt.Fprintf(b, "differ: %s\n", d)
	}
}

// drainStep is rank 0's part of an index-K switch's drain at a step
// input: new requests wait; DrainStep decides from rank 0's core, which
// every rank holds alike, whether the switch goes in, or past the bound
// what the input aborts.
func (gr *group) drainStep(in *groupInput, b *strings.Builder) {
	if gr.drain == nil {
		if len(gr.held) > 0 {
			in.adds, gr.held = append(gr.held, in.adds...), nil
		}
		return
	}
	gr.held, in.adds = append(gr.held, in.adds...), nil
	core := gr.ranks[0].core
	f := DrainFacts{Scheduled: core.Scheduled(), Seqs: core.Len(), PastBound: gr.drain.ran >= gr.drain.bound}
	var held []DrainHeld
	for _, id := range core.IDs() {
		held = append(held, DrainHeld{ID: id, Cut: core.Seq(id).Cut})
	}
	gr.drain.ran++
	d := DrainStep(f, held)
	switch {
	case d.Switch:
		in.switch_, gr.drain = true, nil
		fmt.Fprintf(b, "drain: nothing holds the old precision: switch\n")
	case len(d.Cut) > 0:
		in.aborts = append(in.aborts, d.Cut...)
		fmt.Fprintf(b, "drain: past the bound: abort %v\n", d.Cut)
	default:
		fmt.Fprintf(b, "drain: %d requests hold the old precision; %d new wait\n", f.Seqs, len(gr.held))
	}
}

// rebuild is the supervisor's recovery after a broken group: every
// request the ranks knew ends with the restart's error, the aborts of
// requests they knew die with them, and every rank starts on a new core,
// cursor and pool; what came in meanwhile goes to the new group.
func (gr *group) rebuild() string {
	if !gr.broken {
		return "the group is not broken\n"
	}
	known := gr.ranks[0].core.IDs()
	gr.next.aborts = slices.DeleteFunc(gr.next.aborts, func(id uint64) bool { return slices.Contains(known, id) })
	fresh, err := newGroup(gr.args)
	if err != nil {
		return err.Error() + "\n"
	}
	gr.ranks, gr.broken, gr.drain = fresh.ranks, false, nil
	return fmt.Sprintf("restart: %v end with error: engine restarted; %d ranks rebuilt\n", known, len(gr.ranks))
}

// parted names each rank's phase when the ranks are not all in the same
// one; "" when they are.
func parted(pending []*call) string {
	same := true
	for _, c := range pending {
		if c == nil || c.phase != pending[0].phase {
			same = false
		}
	}
	if same {
		return ""
	}
	var parts []string
	for r, c := range pending {
		if c == nil {
			parts = append(parts, fmt.Sprintf("rank %d ended its iteration", r))
			continue
		}
		parts = append(parts, fmt.Sprintf("rank %d in %s (%v)", r, c.phase, c.phase.Op()))
	}
	return strings.Join(parts, ", ")
}

// show prints an agreed value.
func (gr *group) show(pending []*call) string {
	c := pending[0]
	switch c.phase {
	case Input:
		in := c.msg.(*groupInput)
		var s []string
		for _, a := range in.adds {
			s = append(s, fmt.Sprintf("add %d", a.id))
		}
		for _, id := range in.aborts {
			s = append(s, fmt.Sprintf("abort %d", id))
		}
		if in.switch_ {
			s = append(s, "switch index-K")
		}
		if len(s) == 0 {
			return "nothing new"
		}
		return strings.Join(runs(s), ", ")
	case Room, Fork:
		return fmt.Sprintf("%d pages, %d rows", c.ints[0], c.ints[1])
	case Poll:
		// One vote per room (the least state, and the rank that cast
		// it), then the first token the decode's ranks received, and it
		// negated: the ranks must agree on the token before it joins.
		n := len(c.ints) / 3
		var s []string
		for i, v := range c.ints[:n] {
			st, r := rooms.Unvote(v)
			vote := fmt.Sprintf("%v@%d", st, r)
			if tok := c.ints[n+i]; tok != 0 || c.ints[2*n+i] != 0 {
				vote += fmt.Sprintf(" first %d", tok)
			}
			s = append(s, vote)
		}
		return "[" + strings.Join(runs(s), ", ") + "]"
	case Admit:
		k := len(c.ints) / 3
		var s []string
		for i := range k {
			m := AdmitAgreed(c.ints, i, k)
			s = append(s, fmt.Sprintf("%d on device + %d from host", m.Device, m.Total-m.Device))
		}
		return strings.Join(s, ", ")
	case Agree:
		if !PlansAgree(c.ints) {
			return "plans differ"
		}
		var s []string
		plans := gr.ranks[0].plans
		plan := plans[len(plans)-1]
		for _, it := range plan.Run {
			w := ""
			if it.WantLogits {
				w = "+"
			}
			s = append(s, fmt.Sprintf("%d[%d:%d]%s", it.ID, it.Start, it.Start+it.Tokens, w))
		}
		for _, rt := range plan.Retract {
			s = append(s, fmt.Sprintf("retract %d", rt.ID))
		}
		if len(s) == 0 {
			return "plans agree: nothing to run"
		}
		return "plans agree: " + strings.Join(s, " ")
	case Results:
		res := c.msg.(*groupResults)
		var s []string
		for _, id := range res.cuts {
			s = append(s, fmt.Sprintf("cut %d", id))
		}
		for _, t := range res.toks {
			st := ""
			if t.Stop {
				st = " stop"
			}
			s = append(s, fmt.Sprintf("%d%s", t.Tok, st))
		}
		return "[" + strings.Join(s, " ") + "]"
	}
	return fmt.Sprint(c.ints)
}

// differ compares every rank's core with rank 0's: requests, tokens,
// scheduler queues and the iteration's ends.
func (gr *group) differ() string {
	want := gr.ranks[0].state()
	for _, g := range gr.ranks[1:] {
		if got := g.state(); got != want {
			return fmt.Sprintf("rank %d holds\n%s\nrank 0 holds\n%s", g.r, got, want)
		}
		if err := g.core.sched.Check(); err != nil {
			return fmt.Sprintf("rank %d: %v", g.r, err)
		}
	}
	return ""
}

// state prints what a rank's core holds.
func (g *groupRank) state() string {
	var b strings.Builder
	for _, id := range g.core.IDs() {
		s := g.core.Seq(id)
		fmt.Fprintf(&b, "%d: %d tokens %v", id, len(s.Tokens), s.Tokens[len(s.Tokens)-min(len(s.Tokens), 3):])
		if s.Cut {
			b.WriteString(" cut")
		}
		b.WriteString("\n")
	}
	sn := g.core.Snapshot()
	for _, q := range [][]sched.ReqInfo{sn.Waiting, sn.Running} {
		for _, r := range q {
			fmt.Fprintf(&b, "sched %d %s fed %d gen %d pages %d\n", r.ID, r.State, r.Fed, r.Generated, r.Pages)
		}
	}
	fmt.Fprintf(&b, "pages held %v, ends %v, forks %v, index-K switches %d\n", g.held, g.ends, g.forks, g.switched)
	return b.String()
}

func kv(fields []string) map[string]string {
	m := map[string]string{}
	for _, f := range fields {
		k, v, _ := strings.Cut(f, "=")
		m[k] = v
	}
	return m
}

func tokens(s string) []int32 {
	var out []int32
	for f := range strings.SplitSeq(s, ",") {
		if f != "" {
			out = append(out, int32(atoi(f, 0)))
		}
	}
	return out
}

// TestGroupTraces runs testdata/group-*.txt: ranks of the lock-step loop
// in one goroutine, through their cores. Commands:
//
//	group [ranks=N] [pages=P] [page=S] [rows=R] [running=M] [batch=B] [chunk=C] [loop=overlap] [cache=on]
//	add id=ID prompt=LEN max=M [n=K] [stop=T,T] [ignore-eos]   joins the next input
//	abort id=ID [in-step]          in the next input, or during the next step's forward pass
//	sample id=ID toks=T,T          rank 0's next tokens for ID (7 when none; 0 ends a generation)
//	lose rank=R pages=N            rank R's pool holds N pages fewer (its own view)
//	match rank=R id=ID device=D host=H   rank R's own cache matches D tokens on device, H more on host (cache=on)
//	switch-indexk [bound=K]        an index-K switch's drain from the next input; past K iterations it aborts
//	recover                        the supervisor rebuilds a broken group
//	local rank=R idle              at its next iteration rank R goes idle on its own view
//	step [n=K]                     K iterations of every rank (1)
//	state [rank=R]                 what rank R's core holds (0)
func TestGroupTraces(t *testing.T) {
	tracetest.Run(t, "testdata/group-*.txt", func(t *testing.T) func(string) string {
		var gr *group
		return func(line string) string {
			f := strings.Fields(line)
			args := kv(f[1:])
			if f[0] != "group" && gr == nil {
				return "no group yet\n"
			}
			switch f[0] {
			case "group":
				var err error
				if gr, err = newGroup(args); err != nil {
					return err.Error() + "\n"
				}
				return fmt.Sprintf("%d ranks\n", len(gr.ranks))
			case "add":
				id, plen, max := uint64(atoi(args["id"], 0)), atoi(args["prompt"], 1), atoi(args["max"], 1)
				prompt := make([]int32, plen)
				for i := range prompt {
					prompt[i] = int32(100 + i)
				}
				_, ignore := args["ignore-eos"]
				seq := Seq{Tokens: prompt, MaxTokens: max, IgnoreEOS: ignore, Stop: tokens(args["stop"])}
				gr.next.adds = append(gr.next.adds, groupAdd{id: id, n: atoi(args["n"], 1),
					req: sched.Request{ID: id, PromptLen: plen, MaxTokens: max}, seq: seq})
				return "queued\n"
			case "abort":
				id := uint64(atoi(args["id"], 0))
				if _, ok := args["in-step"]; ok {
					gr.cuts = append(gr.cuts, id)
				} else {
					gr.next.aborts = append(gr.next.aborts, id)
				}
				return "queued\n"
			case "sample":
				id := uint64(atoi(args["id"], 0))
				gr.samples[id] = append(gr.samples[id], tokens(args["toks"])...)
				return "queued\n"
			case "lose":
				g := gr.ranks[atoi(args["rank"], 0)]
				g.pages -= atoi(args["pages"], 0)
				return fmt.Sprintf("rank %d: %d pages\n", g.r, g.pages)
			case "match":
				g := gr.ranks[atoi(args["rank"], 0)]
				device := atoi(args["device"], 0)
				g.matches[uint64(atoi(args["id"], 0))] = Match{Device: device, Total: device + atoi(args["host"], 0)}
				return "matched\n"
			case "switch-indexk":
				gr.drain = &groupDrain{bound: atoi(args["bound"], 3)}
				return "draining\n"
			case "recover":
				return gr.rebuild()
			case "local":
				gr.ranks[atoi(args["rank"], 0)].idle = true
				return "armed\n"
			case "step":
				var b strings.Builder
				n := atoi(args["n"], 1)
				for i := range n {
					if gr.broken {
						b.WriteString("the group is broken\n")
						break
					}
					if n > 1 {
						fmt.Fprintf(&b, "-- iteration %d\n", i+1)
					}
					gr.iterate(&b)
				}
				return b.String()
			case "state":
				return gr.ranks[atoi(args["rank"], 0)].state()
			}
			return fmt.Sprintf("unknown command %q\n", f[0])
		}
	})
}

// runs compresses a list for a trace: consecutive items that differ only
// in numbers, each number the same throughout or counting up by one, are
// written once, a counting number as "first..last" and a repeated item
// with "×n"; other items stay as they are.
func runs(items []string) []string {
	type parsed struct {
		tmpl string
		nums []int
	}
	parse := func(s string) parsed {
		var p parsed
		var t strings.Builder
		for i := 0; i < len(s); {
			if s[i] < '0' || s[i] > '9' {
				t.WriteByte(s[i])
				i++
				continue
			}
			j := i
			for j < len(s) && s[j] >= '0' && s[j] <= '9' {
				j++
			}
			n, _ := strconv.Atoi(s[i:j])
			p.nums = append(p.nums, n)
			t.WriteString("\x00")
			i = j
		}
		p.tmpl = t.String()
		return p
	}
	var out []string
	for i := 0; i < len(items); {
		first := parse(items[i])
		j := i + 1
		var delta []int // per number: 0 the same throughout, 1 counting up
		for ; j < len(items); j++ {
			p := parse(items[j])
			if p.tmpl != first.tmpl {
				break
			}
			if delta == nil {
				delta = make([]int, len(p.nums))
				for k := range p.nums {
					delta[k] = p.nums[k] - first.nums[k]
				}
				if slices.ContainsFunc(delta, func(d int) bool { return d != 0 && d != 1 }) {
					break
				}
			}
			fits := true
			for k, n := range p.nums {
				fits = fits && n == first.nums[k]+delta[k]*(j-i)
			}
			if !fits {
				break
			}
		}
		if j-i < 3 {
			out = append(out, items[i])
			i++
			continue
		}
		last := parse(items[j-1])
		var b strings.Builder
		counting := false
		for k, part := range strings.Split(first.tmpl, "\x00") {
			b.WriteString(part)
			if k < len(first.nums) {
				if delta[k] == 1 {
					fmt.Fprintf(&b, "%d..%d", first.nums[k], last.nums[k])
					counting = true
				} else {
					fmt.Fprintf(&b, "%d", first.nums[k])
				}
			}
		}
		line := b.String()
		if !counting {
			line = fmt.Sprintf("%s ×%d", line, j-i)
		}
		out = append(out, line)
		i = j
	}
	return out
}

// byRequest joins consecutive PD actions of one request ("end 5 ...",
// "forget 5 ...") into one item, so that runs compresses a storm of them.
func byRequest(acts []string) []string {
	var out []string
	last := ""
	for _, a := range acts {
		f := strings.Fields(a)
		id := ""
		if len(f) > 1 {
			id = f[1]
		}
		if len(out) > 0 && id == last {
			out[len(out)-1] += "; " + a
			continue
		}
		out, last = append(out, a), id
	}
	return out
}
