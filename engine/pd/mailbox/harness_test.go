package mailbox

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
	"github.com/pdkit/pdkit/internal/tracetest"
)

// harness drives one rank's mailbox with the trace language:
//
//	config role=prefill|decode [rank=] [per-sender=] [room-bytes=] [sender=] [boot=]
//	file [t=] info room= [from=] [tokens=]
//	file [t=] queued room= [from=] [position=]
//	file [t=] abort room= [from=] [reason=]
//	file [t=] chunk room= [index=] [bytes=]
//	file [t=] status room= [state=] [error=]
//	file [t=] ack room=
//	file [t=] probe [from=] [seq=]
//	file [t=] reply [from=] [boot=]
//	admit room=
//	take room=
//	forget room= [why=]
//	expire t= ttl=
//	probe t= [peer=] [every=] [boot=]
//	liveness t= [peer=]
//	expect room= [peer=]
//	lost t= [peer=]
//	peers t=
//	forget-peers t=
//	state
//
// file, admit, take and forget take n=: the command runs for the n rooms
// from room= on, and what it printed for each is tallied ("60× ..."), with
// the room's own number written "same". Times are offsets from an
// arbitrary wall-clock instant; a heartbeat's time prints as one. After
// every command the harness runs Check: a broken invariant is an error.
// targs are a command's arguments, with the harness's own readings.
type targs struct{ tracetest.Args }

func splitArgs(fields []string) (targs, []string) {
	a, rest := tracetest.SplitArgs(fields)
	return targs{a}, rest
}

type harness struct {
	m *Machine
	// What the caller would count, from the decisions.
	filed, answered, wakes int
	drops                  [len(dropNames)]int
}

// base is the wall-clock instant t=0 of a trace.
var base = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// at is the wall-clock time of t= in a.
func (a targs) at() (time.Time, error) {
	t, err := a.Dur("t", 0)
	return base.Add(t), err
}

// run executes one command line and returns its output.
func (h *harness) run(line string) (string, error) {
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return "", errors.New("empty command")
	}
	cmd := fields[0]
	a, rest := splitArgs(fields[1:])
	if cmd != "config" && h.m == nil {
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
	case "file", "admit", "take", "forget":
		err = h.perRoom(cmd, a, rest, &out)
	case "expire":
		err = h.expire(a, &out)
	case "probe":
		err = h.probe(a, &out)
	case "liveness":
		err = h.liveness(a, &out)
	case "expect":
		room, e := a.Int("room", 0)
		err = e
		h.m.Expect(uint64(room), a.Str("peer", "tcp://prefill"))
	case "lost":
		now, e := a.at()
		err = e
		h.m.Lost(now, a.Str("peer", "tcp://prefill"))
	case "peers":
		err = h.peers(a, &out)
	case "forget-peers":
		now, e := a.at()
		err = e
		h.m.ForgetPeers(now)
	case "state":
		h.state(&out)
	default:
		err = fmt.Errorf("unknown command %q", cmd)
	}
	if err != nil {
		return "", err
	}
	if err := h.m.Check(); err != nil {
		return "", fmt.Errorf("invariant broken: %w", err)
	}
	return out.String(), nil
}

func (h *harness) config(a targs) error {
	c := Config{Role: rooms.Prefill, Sender: a.Str("sender", "tcp://prefill"), Rank: 0}
	switch a.Args["role"] {
	case "prefill":
	case "decode":
		c.Role = rooms.Decode
		c.Sender = a.Str("sender", "tcp://decode")
	default:
		return fmt.Errorf("role=%q: want prefill or decode", a.Args["role"])
	}
	rank, e1 := a.Int("rank", 0)
	per, e2 := a.Int("per-sender", 0)
	rb, e3 := a.Int("room-bytes", 0)
	boot, e4 := a.Int("boot", 1)
	if err := errors.Join(e1, e2, e3, e4); err != nil {
		return err
	}
	c.Rank, c.PerSender, c.RoomBytes, c.Boot = rank, per, int64(rb), uint64(boot)
	m, err := New(c)
	if err != nil {
		return err
	}
	*h = harness{m: m}
	return nil
}

// perRoom runs a room's command for n rooms from room= on: one output
// each for one room, a tally for more.
func (h *harness) perRoom(cmd string, a targs, rest []string, out *strings.Builder) error {
	first, e1 := a.Int("room", 0)
	n, e2 := a.Int("n", 1)
	if err := errors.Join(e1, e2); err != nil {
		return err
	}
	if n < 1 || first < 0 {
		return fmt.Errorf("room=%d n=%d", first, n)
	}
	var tally []string
	count := map[string]int{}
	for i := range n {
		room := uint64(first + i)
		var b strings.Builder
		var err error
		switch cmd {
		case "file":
			err = h.file(room, a, rest, &b)
		case "admit":
			h.m.Admit(room)
		case "take":
			b.WriteString(formatMail(h.m.Take(room)) + "\n")
		case "forget":
			if to, ack := h.m.Forget(room, a.Args["why"], a.Args["asked"] == "true"); ack != nil {
				fmt.Fprintf(&b, "answer %s to=%s\n", formatMessage(ack), to)
			}
		}
		if err != nil {
			return err
		}
		if n == 1 {
			out.WriteString(b.String())
			continue
		}
		for l := range strings.Lines(b.String()) {
			l = strings.ReplaceAll(strings.TrimSuffix(l, "\n"), fmt.Sprintf("room=%d ", room), "room=same ")
			if count[l] == 0 {
				tally = append(tally, l)
			}
			count[l]++
		}
	}
	for _, l := range tally {
		fmt.Fprintf(out, "%d× %s\n", count[l], l)
	}
	return nil
}

// file builds the message a's kind names for room and files it.
func (h *harness) file(room uint64, a targs, rest []string, out *strings.Builder) error {
	now, err := a.at()
	if err != nil {
		return err
	}
	if len(rest) != 1 {
		return errors.New("file: want one of info, queued, abort, chunk, status, ack, probe, reply")
	}
	rank := uint32(h.m.cfg.Rank)
	from := a.Str("from", "tcp://decode")
	var msg pdproto.Message
	switch rest[0] {
	case "info":
		tokens, err := a.Int("tokens", 8)
		if err != nil {
			return err
		}
		msg = &pdproto.TransferInfo{Room: room, Endpoint: from, Rank: rank, Tokens: uint32(tokens)}
	case "queued":
		pos, err := a.Int("position", 0)
		if err != nil {
			return err
		}
		msg = &pdproto.Queued{Room: room, Endpoint: from, Rank: rank, Position: uint32(pos)}
	case "abort":
		msg = &pdproto.Abort{Room: room, Endpoint: from, Rank: rank, Reason: a.Str("reason", "client gone")}
	case "chunk":
		idx, e1 := a.Int("index", 0)
		n, e2 := a.Int("bytes", 1024)
		if err := errors.Join(e1, e2); err != nil {
			return err
		}
		if n < 0 || idx < 0 {
			return errors.New("chunk: negative field")
		}
		msg = &pdproto.KVChunk{Room: room, Chunk: uint32(idx), Start: uint32(4 * idx), End: uint32(4*idx + 4), Layers: []pdproto.LayerKV{{K: make([]byte, n)}}}
	case "status":
		st, ok := pdproto.ParseKVPoll(a.Str("state", "Success"))
		if !ok {
			return fmt.Errorf("state=%q: want a KVPoll name", a.Args["state"])
		}
		msg = &pdproto.Status{Room: room, Rank: rank, State: st, Error: a.Args["error"]}
	case "ack":
		msg = &pdproto.AbortAck{Room: room, Rank: rank}
	case "probe":
		seq, err := a.Int("seq", 1)
		if err != nil {
			return err
		}
		msg = &pdproto.Heartbeat{Sender: from, Seq: uint64(seq), UnixNano: now.UnixNano()}
	case "reply":
		boot, err := a.Int("boot", 7)
		if err != nil {
			return err
		}
		msg = &pdproto.Heartbeat{Sender: a.Str("from", "tcp://prefill"), Boot: uint64(boot), UnixNano: now.UnixNano(), Reply: true}
	default:
		return fmt.Errorf("file %s: unknown kind", rest[0])
	}
	d := h.m.File(now, msg)
	h.count(d)
	out.WriteString(Format(d) + heartbeatTime(d.Answer) + "\n")
	return nil
}

// count keeps the caller's counters of d.
func (h *harness) count(d Decision) {
	h.drops[d.Drop]++
	if d.Filed {
		h.filed++
	}
	if d.Wake {
		h.wakes++
	}
	if d.Answer != nil {
		h.answered++
	}
}

// heartbeatTime is the time a heartbeat carries, on the trace's clock.
func heartbeatTime(m pdproto.Message) string {
	if hb, ok := m.(*pdproto.Heartbeat); ok {
		return fmt.Sprintf(" at=%v", time.Unix(0, hb.UnixNano).Sub(base))
	}
	return ""
}

func formatMail(m rooms.Mail) string {
	if m.Empty() {
		return "empty"
	}
	var parts []string
	if m.Info != nil {
		parts = append(parts, fmt.Sprintf("info from=%s tokens=%d", m.Info.Endpoint, m.Info.Tokens))
	}
	if m.Queued != nil {
		parts = append(parts, fmt.Sprintf("queued from=%s position=%d", m.Queued.Endpoint, m.Queued.Position))
	}
	if m.Abort != nil {
		parts = append(parts, fmt.Sprintf("abort from=%s %q", m.Abort.Endpoint, m.Abort.Reason))
	}
	if len(m.Chunks) > 0 {
		n := 0
		idx := make([]string, len(m.Chunks))
		for i, c := range m.Chunks {
			n += c.PayloadBytes()
			idx[i] = strconv.Itoa(int(c.Chunk))
		}
		parts = append(parts, fmt.Sprintf("chunks [%s] bytes=%d", strings.Join(idx, " "), n))
	}
	if m.Status != nil {
		parts = append(parts, fmt.Sprintf("status %v", m.Status.State))
	}
	if m.Acked {
		parts = append(parts, "acked")
	}
	return strings.Join(parts, "; ")
}

func (h *harness) expire(a targs, out *strings.Builder) error {
	now, e1 := a.at()
	ttl, e2 := a.Dur("ttl", 10*time.Second)
	if err := errors.Join(e1, e2); err != nil {
		return err
	}
	n := h.m.Expire(now.Add(-ttl))
	h.drops[Late] += n
	fmt.Fprintf(out, "expired %d\n", n)
	return nil
}

func (h *harness) probe(a targs, out *strings.Builder) error {
	now, e1 := a.at()
	every, e2 := a.Dur("every", time.Second)
	boot, e3 := a.Int("boot", int(h.m.cfg.Boot))
	if err := errors.Join(e1, e2, e3); err != nil {
		return err
	}
	hb := h.m.Probe(now, a.Str("peer", "tcp://prefill"), uint64(boot), every)
	if hb == nil {
		out.WriteString("no probe\n")
		return nil
	}
	fmt.Fprintf(out, "send %s%s\n", formatMessage(hb), heartbeatTime(hb))
	return nil
}

func (h *harness) liveness(a targs, out *strings.Builder) error {
	now, err := a.at()
	if err != nil {
		return err
	}
	l := h.m.Liveness(now, a.Str("peer", "tcp://prefill"))
	fmt.Fprintf(out, "silent=%v boot=%d\n", l.Silent, l.Boot)
	return nil
}

// peers prints the peer table at t=, each time on the trace's clock.
func (h *harness) peers(a targs, out *strings.Builder) error {
	now, err := a.at()
	if err != nil {
		return err
	}
	at := func(t time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return t.Sub(base).String()
	}
	for _, p := range h.m.Peers(now) {
		fmt.Fprintf(out, "%s boot=%d heard=%s probed=%s silent=%v lost=%d at %s boot then %d\n", p.Endpoint, p.Boot, at(p.Heard), at(p.Probed), p.Silent, p.Lost, at(p.LostAt), p.LostBoot)
	}
	return nil
}

// state prints the rooms (each, when there are few), the early rooms by
// sender, the ended rooms, the peers and the caller's counters.
func (h *harness) state(out *strings.Builder) {
	m := h.m
	ids := slices.Sorted(maps.Keys(m.rooms))
	fmt.Fprintf(out, "rooms: %d with mail, %d early, %d known\n", len(ids), m.early, len(m.known))
	if len(ids) <= 8 {
		for _, id := range ids {
			x := m.rooms[id]
			state := "known"
			if !m.known[id] {
				state = "early from " + x.from
			}
			fmt.Fprintf(out, "  %d %s: %s\n", id, state, formatMail(x.Mail))
		}
	}
	if len(m.earlyFrom) > 0 {
		var parts []string
		for _, s := range slices.Sorted(maps.Keys(m.earlyFrom)) {
			parts = append(parts, fmt.Sprintf("%s=%d", or(s, `""`), m.earlyFrom[s]))
		}
		fmt.Fprintf(out, "early by sender: %s\n", strings.Join(parts, " "))
	}
	if len(m.ended) > 0 {
		fmt.Fprintf(out, "ended: %d remembered, %d in the FIFO", len(m.ended), len(m.endedOrder))
		if len(m.endedOrder) <= 4 {
			for _, id := range m.endedOrder {
				if e, ok := m.ended[id]; ok {
					fmt.Fprintf(out, "; %d %q", id, e.why)
				}
			}
		}
		out.WriteString("\n")
	}
	for _, s := range slices.Sorted(maps.Keys(m.peers)) {
		p := m.peers[s]
		unanswered := "none"
		if !p.unanswered.IsZero() {
			unanswered = "since " + p.unanswered.Sub(base).String()
		}
		fmt.Fprintf(out, "peer %s: probe=%d unanswered %s boot=%d\n", s, p.probe, unanswered, p.boot)
	}
	fmt.Fprintf(out, "counts: filed=%d answered=%d late=%d misplaced=%d over-quota=%d\n",
		h.filed, h.answered, h.drops[Late], h.drops[Misplaced], h.drops[OverQuota])
}

func or(v, def string) string {
	if v == "" {
		return def
	}
	return v
}
