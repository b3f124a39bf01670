package rooms

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/internal/tracetest"
)

// harness drives one TP group's machines, one per rank, with the trace
// language:
//
//	config role=prefill|decode ranks=N [bootstrap= transfer= inflight= ack= heartbeat= request= queued= reserve= page= indexk=]
//	admit id= room= prompt= [max=] [url=] t=
//	mail id= [rank=] [t=] info [endpoint=] [tokens=] [dtype=] [from=]
//	mail id= [rank=] [t=] queued [position=]
//	mail id= [rank=] abort [endpoint=] [reason=]
//	mail id= [rank=] chunk index= start= end= [first=]
//	mail id= [rank=] status=Success|Failed [error=]
//	mail id= [rank=] acked
//	resolve id= [rank=] endpoint= | err=
//	peer endpoint= [rank=] [silent=] [boot=]
//	send-failed id= [rank=] what= err=
//	write-failed id= [rank=] err=
//	poll t=
//	grant t= free= rows= [growth=] [slots=]
//	abort id= t= [why=]
//	sched-finished id= t= produced=true|false [why=]
//	sent id= end= [first=]
//	state
//
// A command without rank= goes to every rank. Each rank gets its own peer
// endpoints: "tcp://x" becomes "tcp://x/rN" on rank N. After every command
// the harness checks that the ranks agree on every room's phase and agreed
// state; a disagreement is an error, as it would be a desync.
// targs are a command's arguments, with the harness's own readings.
type targs struct{ tracetest.Args }

func splitArgs(fields []string) (targs, []string) {
	a, rest := tracetest.SplitArgs(fields)
	return targs{a}, rest
}

type harness struct {
	cfg Config
	ms  []*Machine
}

// ranks are the machines a command with args a goes to.
func (h *harness) ranks(a targs) ([]int, error) {
	if v, ok := a.Args["rank"]; ok {
		r, err := strconv.Atoi(v)
		if err != nil || r < 0 || r >= len(h.ms) {
			return nil, fmt.Errorf("rank=%q: want 0 to %d", v, len(h.ms)-1)
		}
		return []int{r}, nil
	}
	out := make([]int, len(h.ms))
	for i := range out {
		out[i] = i
	}
	return out, nil
}

func onRank(endpoint string, r int) string { return fmt.Sprintf("%s/r%d", endpoint, r) }

// run executes one command line and returns its output.
func (h *harness) run(line string) (string, error) {
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return "", errors.New("empty command")
	}
	cmd := fields[0]
	a, rest := splitArgs(fields[1:])
	if cmd != "config" && h.ms == nil {
		return "", errors.New("config first")
	}
	var out strings.Builder
	var err error
	switch cmd {
	case "config":
		err = h.config(a)
		if err == nil {
			out.WriteString("ok\n")
		}
	case "admit":
		err = h.admit(a)
	case "mail":
		err = h.mail(a, rest, &out)
	case "resolve":
		err = h.resolve(a)
	case "peer":
		err = h.peer(a)
	case "send-failed", "write-failed":
		err = h.failed(cmd, a)
	case "poll":
		err = h.poll(a, &out)
	case "grant":
		err = h.grant(a, &out)
	case "abort":
		err = h.abort(a, &out)
	case "sched-finished":
		err = h.schedFinished(a, &out)
	case "sent":
		err = h.sent(a, &out)
	case "indexk":
		err = h.indexK(a, &out)
	case "state":
	default:
		err = fmt.Errorf("unknown command %q", cmd)
	}
	if err != nil {
		return "", err
	}
	if err := h.agree(); err != nil {
		return "", err
	}
	if cmd != "config" {
		h.state(&out)
	}
	return out.String(), nil
}

func (h *harness) config(a targs) error {
	c := Config{Role: Prefill, PageSize: 4, IndexKDType: "fp8", ReservedDecodeTokens: -1}
	switch a.Args["role"] {
	case "prefill":
	case "decode":
		c.Role = Decode
	default:
		return fmt.Errorf("role=%q: want prefill or decode", a.Args["role"])
	}
	var err error
	n, err1 := a.Int("ranks", 1)
	c.PageSize, err = a.Int("page", c.PageSize)
	c.ReservedDecodeTokens, _ = a.Int("reserve", c.ReservedDecodeTokens)
	if v, ok := a.Args["indexk"]; ok {
		c.IndexKDType = v
	}
	var errs []error
	for _, d := range []struct {
		k   string
		p   *time.Duration
		def time.Duration
	}{{"bootstrap", &c.BootstrapTimeout, 10 * time.Second}, {"transfer", &c.TransferTimeout, 30 * time.Second},
		{"inflight", &c.InflightTimeout, 10 * time.Second}, {"ack", &c.AbortAckTimeout, 5 * time.Second},
		{"heartbeat", &c.HeartbeatTimeout, 3 * time.Second}, {"request", &c.RequestTimeout, 0},
		{"queued", &c.QueuedInterval, 500 * time.Millisecond}} {
		var derr error
		*d.p, derr = a.Dur(d.k, d.def)
		errs = append(errs, derr)
	}
	if err := errors.Join(append(errs, err, err1)...); err != nil {
		return err
	}
	if n < 1 || n > 8 {
		return fmt.Errorf("ranks=%d: want 1 to 8", n)
	}
	h.cfg, h.ms = c, nil
	for r := range n {
		c.Rank = r
		m, err := New(c)
		if err != nil {
			return err
		}
		h.ms = append(h.ms, m)
	}
	return nil
}

func (h *harness) admit(a targs) error {
	id, err1 := a.Int("id", 0)
	rm, err2 := a.Int("room", id)
	prompt, err3 := a.Int("prompt", 8)
	mx, err4 := a.Int("max", 1)
	t, err5 := a.Dur("t", 0)
	if err := errors.Join(err1, err2, err3, err4, err5); err != nil {
		return err
	}
	for _, m := range h.ms {
		if err := m.Admit(t, Request{ID: uint64(id), Room: uint64(rm), PromptLen: prompt, MaxTokens: mx, URL: a.Args["url"], Prompt: a.fingerprint()}); err != nil {
			return err
		}
	}
	return nil
}

func (h *harness) mail(a targs, rest []string, out *strings.Builder) error {
	id, ranks, err := h.idRanks(a)
	if err != nil {
		return err
	}
	t, err := a.Dur("t", 0)
	if err != nil {
		return err
	}
	kind := ""
	if len(rest) > 0 {
		kind = rest[0]
	} else if _, ok := a.Args["status"]; ok {
		kind = "status"
	}
	for _, r := range ranks {
		m := h.ms[r]
		var mail Mail
		switch kind {
		case "info":
			tokens, err := a.Int("tokens", 0)
			from, err2 := a.Int("from", r)
			if err := errors.Join(err, err2); err != nil {
				return err
			}
			dtype := m.cfg.IndexKDType
			if v, ok := a.Args["dtype"]; ok {
				dtype = v
			}
			mail.Info = &pdproto.TransferInfo{Room: id, Endpoint: onRank(or(a.Args["endpoint"], "tcp://decode"), r), Rank: uint32(from), Tokens: uint32(tokens), IndexKDType: dtype,
				Prompt: a.fingerprint()}
		case "abort":
			mail.Abort = &pdproto.Abort{Room: id, Endpoint: onRank(or(a.Args["endpoint"], "tcp://decode"), r), Rank: uint32(r), Reason: or(a.Args["reason"], "client gone")}
		case "chunk":
			idx, e1 := a.Int("index", 0)
			start, e2 := a.Int("start", 0)
			end, e3 := a.Int("end", 0)
			if err := errors.Join(e1, e2, e3); err != nil {
				return err
			}
			if start < 0 || end < 0 || idx < 0 {
				return errors.New("chunk: negative field")
			}
			ch := &pdproto.KVChunk{Room: id, Chunk: uint32(idx), Start: uint32(start), End: uint32(end), Prompt: a.fingerprint(),
				Layers: []pdproto.LayerKV{{K: make([]byte, 4*max(0, end-start))}}}
			if v, ok := a.Args["first"]; ok {
				tok, err := strconv.Atoi(v)
				if err != nil {
					return fmt.Errorf("first=%q: %v", v, err)
				}
				ch.Final = &pdproto.ChunkFinal{FirstToken: int32(tok), PromptTokens: uint32(end)}
			}
			mail.Chunks = []*pdproto.KVChunk{ch}
		case "status":
			st, ok := pdproto.ParseKVPoll(a.Args["status"])
			if !ok {
				return fmt.Errorf("status=%q: want a KVPoll name", a.Args["status"])
			}
			mail.Status = &pdproto.Status{Room: id, Rank: uint32(r), State: st, Error: a.Args["error"]}
		case "acked":
			mail.Acked = true
		case "queued":
			pos, err := a.Int("position", 0)
			if err != nil {
				return err
			}
			mail.Queued = &pdproto.Queued{Room: id, Rank: uint32(r), Position: uint32(pos)}
		default:
			return fmt.Errorf("mail: want info, queued, abort, chunk, status= or acked")
		}
		h.print(out, r, m.File(t, id, mail))
	}
	return nil
}

// fingerprint is the fingerprint of the prompt named by fp= (its bytes as
// tokens); none (zero) without.
func (a targs) fingerprint() pdproto.Fingerprint {
	name, ok := a.Args["fp"]
	if !ok {
		return pdproto.Fingerprint{}
	}
	var toks []int32
	for _, c := range []byte(name) {
		toks = append(toks, int32(c))
	}
	return pdproto.PromptFingerprint(toks)
}

func or(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

// idRanks reads a command's id= and the ranks it goes to.
func (h *harness) idRanks(a targs) (uint64, []int, error) {
	id, err := a.Int("id", 0)
	if err != nil {
		return 0, nil, err
	}
	ranks, err := h.ranks(a)
	return uint64(id), ranks, err
}

func (h *harness) resolve(a targs) error {
	id, ranks, err := h.idRanks(a)
	if err != nil {
		return err
	}
	for _, r := range ranks {
		res := Resolution{Endpoint: onRank(or(a.Args["endpoint"], "tcp://prefill"), r)}
		if e, ok := a.Args["err"]; ok {
			res = Resolution{Err: errors.New(e)}
		}
		h.ms[r].Resolve(id, res)
	}
	return nil
}

func (h *harness) peer(a targs) error {
	ranks, err := h.ranks(a)
	if err != nil {
		return err
	}
	silent, err1 := a.Dur("silent", 0)
	boot, err2 := a.Int("boot", 0)
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	for _, r := range ranks {
		h.ms[r].Peer(onRank(or(a.Args["endpoint"], "tcp://prefill"), r), Liveness{Silent: silent, Boot: uint64(boot)})
	}
	return nil
}

func (h *harness) failed(cmd string, a targs) error {
	id, ranks, err := h.idRanks(a)
	if err != nil {
		return err
	}
	for _, r := range ranks {
		if cmd == "send-failed" {
			h.ms[r].SendFailed(id, or(a.Args["what"], "a message"), errors.New(or(a.Args["err"], "send timed out")))
		} else {
			h.ms[r].Failed(id, Reason{Kind: KindBadChunk, Text: or(a.Args["err"], "write failed")})
		}
	}
	return nil
}

func (h *harness) poll(a targs, out *strings.Builder) error {
	t, err := a.Dur("t", 0)
	if err != nil {
		return err
	}
	agreed, votes := Poll(h.ms, t)
	for r, v := range votes {
		fmt.Fprintf(out, "votes r%d: %s\n", r, formatVotes(v))
	}
	fmt.Fprintf(out, "agreed: %s\n", formatVotes(agreed))
	for r, m := range h.ms {
		acts, err := m.Apply(t, agreed)
		if err != nil {
			return err
		}
		h.print(out, r, acts)
	}
	return nil
}

// Poll runs one poll of a group of machines in one process: every rank's
// votes and their MIN, as the loop's all-reduce computes it.
func Poll(ms []*Machine, now time.Duration) (agreed []int64, votes [][]int64) {
	for _, m := range ms {
		v := m.Votes(now)
		votes = append(votes, v)
		if agreed == nil {
			agreed = slices.Clone(v)
			continue
		}
		for i := range agreed {
			agreed[i] = min(agreed[i], v[i])
		}
	}
	return agreed, votes
}

// formatVotes shows the votes of a poll (its first third).
func formatVotes(v []int64) string {
	v = v[:len(v)/3]
	parts := make([]string, len(v))
	for i, x := range v {
		st, r := Unvote(x)
		parts[i] = fmt.Sprintf("%v@%d", st, r)
	}
	return "[" + strings.Join(parts, " ") + "]"
}

func (h *harness) grant(a targs, out *strings.Builder) error {
	t, e1 := a.Dur("t", 0)
	free, e2 := a.Int("free", 0)
	rows, e3 := a.Int("rows", 0)
	growth, e4 := a.Int("growth", 0)
	slots, e5 := a.Int("slots", 0)
	if err := errors.Join(e1, e2, e3, e4, e5); err != nil {
		return err
	}
	for r, m := range h.ms {
		left, acts := m.Grant(t, Budget{FreePages: free, FreeRows: rows, SchedGrowth: growth, SchedSlots: slots})
		if r == 0 {
			fmt.Fprintf(out, "pages left for the scheduler: %d\n", left)
		}
		h.print(out, r, acts)
	}
	return nil
}

// indexK switches every rank's index-K precision, printing each refusal.
func (h *harness) indexK(a targs, out *strings.Builder) error {
	dt, ok := a.Args["dt"]
	if !ok {
		return errors.New("indexk: want dt=")
	}
	for r, m := range h.ms {
		if err := m.SetIndexKDType(dt); err != nil {
			fmt.Fprintf(out, "r%d refused: %v\n", r, err)
		}
	}
	return nil
}

func (h *harness) abort(a targs, out *strings.Builder) error {
	id, e1 := a.Int("id", 0)
	t, e2 := a.Dur("t", 0)
	if err := errors.Join(e1, e2); err != nil {
		return err
	}
	h.each(out, "the caller aborts it in the scheduler", func(m *Machine) ([]Action, bool) {
		return m.Abort(t, uint64(id), or(a.Args["why"], "abort"))
	})
	return nil
}

// each runs an agreed event on every rank and prints its actions, and
// once, when the machine left it to the caller, what the caller does.
func (h *harness) each(out *strings.Builder, caller string, event func(*Machine) ([]Action, bool)) {
	for r, m := range h.ms {
		acts, handled := event(m)
		if !handled && r == 0 {
			out.WriteString("not handled: " + caller + "\n")
		}
		h.print(out, r, acts)
	}
}

func (h *harness) schedFinished(a targs, out *strings.Builder) error {
	id, e1 := a.Int("id", 0)
	t, e2 := a.Dur("t", 0)
	produced, e3 := strconv.ParseBool(or(a.Args["produced"], "true"))
	if err := errors.Join(e1, e2, e3); err != nil {
		return err
	}
	h.each(out, "the caller ends it by the scheduler's reason", func(m *Machine) ([]Action, bool) {
		return m.SchedFinished(t, uint64(id), produced, or(a.Args["why"], "abort"))
	})
	return nil
}

func (h *harness) sent(a targs, out *strings.Builder) error {
	id, e1 := a.Int("id", 0)
	end, e2 := a.Int("end", 0)
	if err := errors.Join(e1, e2); err != nil {
		return err
	}
	var final *pdproto.ChunkFinal
	if v, ok := a.Args["first"]; ok {
		tok, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("first=%q: %v", v, err)
		}
		final = &pdproto.ChunkFinal{FirstToken: int32(tok), PromptTokens: uint32(end)}
	}
	for r, m := range h.ms {
		h.print(out, r, m.Sent(uint64(id), end, final))
	}
	return nil
}

func (h *harness) print(out *strings.Builder, r int, acts []Action) {
	for _, act := range acts {
		if len(h.ms) > 1 {
			fmt.Fprintf(out, "r%d: ", r)
		}
		out.WriteString(Format(act) + "\n")
	}
}

// agree checks that every rank holds the same rooms in the same phases
// with the same agreed state.
func (h *harness) agree() error {
	key := func(m *Machine) string {
		var b strings.Builder
		for _, e := range m.Entries() {
			fmt.Fprintf(&b, "%d:%v:%v ", e.ID, e.Phase, e.Agreed)
		}
		return b.String()
	}
	for r, m := range h.ms {
		if err := m.Check(); err != nil {
			return fmt.Errorf("invariant broken on rank %d: %w", r, err)
		}
		if k0, k := key(h.ms[0]), key(m); k != k0 {
			return fmt.Errorf("invariant broken: ranks disagree: r0 %q, r%d %q", k0, r, k)
		}
	}
	return nil
}

// state prints rank 0's rooms, and each rank's own failure reason where
// they differ.
func (h *harness) state(out *strings.Builder) {
	for r, m := range h.ms {
		if n := m.Stats().Misplaced; n > 0 {
			fmt.Fprintf(out, "r%d misplaced: %d\n", r, n)
		}
	}
	es := h.ms[0].Entries()
	if len(es) == 0 {
		out.WriteString("rooms: none\n")
		return
	}
	parts := make([]string, len(es))
	for i, e := range es {
		parts[i] = fmt.Sprintf("%d:%v", e.ID, e.Phase)
	}
	out.WriteString("rooms: " + strings.Join(parts, " ") + "\n")
}
