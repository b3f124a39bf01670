package mailbox

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/rooms"
)

// TestRandomSequences drives a mailbox of either role, with small bounds,
// through seeded random events (mail of every type for a few rooms from a
// few senders, admissions, takes, forgets, expiry, heartbeats, the clock
// moving) and checks after each that Check holds (the early count is the
// rooms not known, the count by sender sums to it, no bound is passed),
// that every decision is well formed, that an ABORT a prefill keeps for a
// room it does not have is acked at once with that room, and that a take
// returns exactly what was filed since the last one: nothing filed is
// lost, nothing dropped appears.
func TestRandomSequences(t *testing.T) {
	for seed := range uint64(2000) {
		if err := runRandom(seed); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
}

// want is what a room's next take must return.
type want struct {
	info   *pdproto.TransferInfo
	queued *pdproto.Queued
	abort  *pdproto.Abort
	status *pdproto.Status
	chunks []*pdproto.KVChunk
	acked  bool
}

func runRandom(seed uint64) (err error) {
	rng := rand.New(rand.NewPCG(seed, 0x6d61696c))
	cfg := Config{Role: rooms.Role(rng.IntN(2)), Rank: rng.IntN(4), PerSender: rng.IntN(4), Sender: "tcp://self", Boot: 9}
	if rng.IntN(2) == 0 {
		cfg.RoomBytes = int64(1 + rng.IntN(4096))
	}
	m, err := New(cfg)
	if err != nil {
		return err
	}
	m.bound = 1 + rng.IntN(8)
	prefill := cfg.Role == rooms.Prefill
	senders := []string{"tcp://a", "tcp://b", "tcp://c"}
	peers := []string{"tcp://p0", "tcp://p1"}
	now := base
	wants := map[uint64]*want{}
	var trace []string
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\nconfig %+v bound %d\ntrace:\n%s", err, cfg, m.bound, strings.Join(trace, "\n"))
		}
	}()
	for range 50 + rng.IntN(250) {
		room := uint64(rng.IntN(12))
		from := senders[rng.IntN(len(senders))]
		switch op := rng.IntN(20); {
		case op < 11:
			msg := randomMessage(rng, room, from, peers)
			known := m.known[room]
			d := m.File(now, msg)
			trace = append(trace, fmt.Sprintf("%v file %s: %s", now.Sub(base), describe(msg), Format(d)))
			if err := checkDecision(d, msg, prefill, known); err != nil {
				return err
			}
			if d.Filed {
				w := wants[room]
				if w == nil {
					w = &want{}
					wants[room] = w
				}
				switch msg := msg.(type) {
				case *pdproto.TransferInfo:
					w.info = msg
				case *pdproto.Queued:
					w.queued = msg
				case *pdproto.Abort:
					w.abort = msg
				case *pdproto.Status:
					w.status = msg
				case *pdproto.KVChunk:
					w.chunks = append(w.chunks, msg)
				case *pdproto.AbortAck:
					w.acked = true
				}
			}
		case op < 13:
			m.Admit(room)
			trace = append(trace, fmt.Sprintf("admit %d", room))
		case op < 15:
			got := m.Take(room)
			trace = append(trace, fmt.Sprintf("take %d: %s", room, formatMail(got)))
			if err := checkTake(got, wants[room]); err != nil {
				return fmt.Errorf("take %d: %w", room, err)
			}
			delete(wants, room)
		case op < 16:
			why := ""
			if rng.IntN(2) == 0 {
				why = "failed"
			}
			hadAbort := wants[room] != nil && wants[room].abort != nil
			to, ack := m.Forget(room, why, false)
			trace = append(trace, fmt.Sprintf("forget %d %q: ack %v", room, why, ack != nil))
			if (ack != nil) != (hadAbort && prefill) || (ack != nil && (to != wants[room].abort.Endpoint || !ack.Known || ack.Room != room)) {
				return fmt.Errorf("forget %d: answered %q %+v, an ABORT left behind %v", room, to, ack, hadAbort)
			}
			delete(wants, room)
		case op < 17:
			ttl := time.Duration(rng.IntN(10)) * time.Second
			before := map[uint64]bool{}
			for id := range m.rooms {
				before[id] = true
			}
			n := m.Expire(now.Add(-ttl))
			trace = append(trace, fmt.Sprintf("%v expire ttl=%v: %d", now.Sub(base), ttl, n))
			gone := 0
			for id := range before {
				if m.rooms[id] == nil {
					if m.known[id] {
						return fmt.Errorf("expire took known room %d", id)
					}
					delete(wants, id)
					gone++
				}
			}
			if gone != n {
				return fmt.Errorf("expire said %d rooms went, %d did", n, gone)
			}
		case op < 19:
			p := peers[rng.IntN(len(peers))]
			hb := m.Probe(now, p, cfg.Boot, time.Second)
			trace = append(trace, fmt.Sprintf("%v probe %s: %v", now.Sub(base), p, hb != nil))
			if l := m.Liveness(now, p); l.Silent < 0 || (hb != nil && hb.Sender != cfg.Sender) {
				return fmt.Errorf("probe %s: %+v, liveness %+v", p, hb, l)
			}
		default:
			now = now.Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
		}
		if err := m.Check(); err != nil {
			return err
		}
	}
	return nil
}

func randomMessage(rng *rand.Rand, room uint64, from string, peers []string) pdproto.Message {
	switch rng.IntN(8) {
	case 0:
		return &pdproto.TransferInfo{Room: room, Endpoint: from, Tokens: 8}
	case 1:
		return &pdproto.Queued{Room: room, Endpoint: from, Position: uint32(rng.IntN(5))}
	case 2:
		return &pdproto.Abort{Room: room, Endpoint: from, Reason: "gone"}
	case 3:
		return &pdproto.Status{Room: room, State: pdproto.Failed}
	case 4:
		return &pdproto.AbortAck{Room: room}
	case 5:
		return &pdproto.Heartbeat{Sender: peers[rng.IntN(len(peers))], Seq: 1, Boot: uint64(rng.IntN(3)), Reply: rng.IntN(2) == 0}
	}
	return &pdproto.KVChunk{Room: room, End: 1, Layers: []pdproto.LayerKV{{K: make([]byte, rng.IntN(2048))}}}
}

func describe(msg pdproto.Message) string {
	room, _ := pdproto.RoomOf(msg)
	return fmt.Sprintf("%v room=%d", msg.Type(), room)
}

// checkDecision checks that d is well formed for msg, filed on a mailbox
// of the role that did (known: whether the loop had msg's room).
func checkDecision(d Decision, msg pdproto.Message, prefill, known bool) error {
	switch {
	case d.Filed && (d.Drop != Kept || !d.Wake):
		return fmt.Errorf("filed and dropped or not woken: %+v", d)
	case d.Drop != Kept && (d.Answer != nil || d.Wake):
		return fmt.Errorf("dropped and answered or woken: %+v", d)
	case d.Answer != nil && d.To == "":
		return fmt.Errorf("an answer to no one: %+v", d)
	}
	if a, ok := msg.(*pdproto.Abort); ok && prefill && d.Drop == Kept {
		ack, isAck := d.Answer.(*pdproto.AbortAck)
		if known != (d.Answer == nil) || (!known && (!isAck || ack.Room != a.Room || ack.Known || d.To != a.Endpoint)) {
			return fmt.Errorf("an ABORT for room %d (known %v) answered %+v", a.Room, known, d)
		}
	}
	return nil
}

// checkTake checks that a take returned exactly what was filed since the
// room's last take (w; nil: nothing).
func checkTake(got rooms.Mail, w *want) error {
	if w == nil {
		w = &want{}
	}
	if got.Info != w.info || got.Queued != w.queued || got.Abort != w.abort || got.Status != w.status ||
		got.Acked != w.acked || !slices.Equal(got.Chunks, w.chunks) {
		return fmt.Errorf("took %s, filed %+v", formatMail(got), *w)
	}
	return nil
}
