package kvcache

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// modelSeq is the test's plain model of one sequence.
type modelSeq struct {
	s           *Seq
	n, reserved int
}

// driver applies operations to a pool and to a plain model side by side,
// checking after each that results, footprints, free pages and Check agree.
type driver struct {
	t      testing.TB
	p      *Pool
	cfg    Config
	live   map[uint64]*modelSeq
	order  []uint64 // live ids in creation order, for deterministic choice
	dead   []*Seq   // released sequences, to poke again
	nextID uint64
	hits   map[string]int // outcomes seen, to show the test reaches them
}

func newDriver(t testing.TB, cfg Config) *driver {
	return &driver{t: t, p: newPool(t, cfg), cfg: cfg, live: map[uint64]*modelSeq{}, hits: map[string]int{}}
}

func (d *driver) usedPages() int {
	n := 0
	for _, m := range d.live {
		n += d.cfg.PagesFor(m.n + m.reserved)
	}
	return n
}

func (d *driver) fail(op string, err error) {
	d.t.Helper()
	d.t.Fatalf("%s: %v", op, err)
}

// step performs one operation chosen by op and the argument x.
func (d *driver) step(op, x int) {
	d.t.Helper()
	p, c := d.p, d.cfg
	var pick *modelSeq
	if len(d.order) > 0 {
		pick = d.live[d.order[x%len(d.order)]]
	}
	desc := ""
	switch op % 6 {
	case 0: // NewSeq, sometimes with a live id
		id := d.nextID
		if pick != nil && x%5 == 0 {
			id = pick.s.ID()
		}
		desc = fmt.Sprintf("NewSeq(%d)", id)
		s, err := p.NewSeq(id)
		d.outcome("NewSeq", err)
		switch {
		case d.live[id] != nil:
			if !errors.Is(err, ErrDuplicateSeq) {
				d.fail(desc, fmt.Errorf("got %v, want ErrDuplicateSeq", err))
			}
		case len(d.live) == c.MaxSeqs:
			if !errors.Is(err, ErrNoRow) {
				d.fail(desc, fmt.Errorf("got %v, want ErrNoRow", err))
			}
		case err != nil:
			d.fail(desc, err)
		default:
			d.live[id] = &modelSeq{s: s}
			d.order = append(d.order, id)
			d.nextID++
		}
	case 1, 2: // Reserve
		if pick == nil {
			return
		}
		n := x % (2*c.PageSize + 3)
		if x%17 == 0 {
			n = c.MaxContext // often too much
		}
		desc = fmt.Sprintf("Reserve(seq %d len %d res %d, %d)", pick.s.ID(), pick.n, pick.reserved, n)
		err := p.Reserve(pick.s, n)
		d.outcome("Reserve", err)
		target := max(pick.n+n, pick.n+pick.reserved)
		need := c.PagesFor(target) - c.PagesFor(pick.n+pick.reserved)
		switch {
		case pick.n+n > c.MaxContext:
			if !errors.Is(err, ErrContextFull) {
				d.fail(desc, fmt.Errorf("got %v, want ErrContextFull", err))
			}
		case need > c.Pages-d.usedPages():
			if !errors.Is(err, ErrOutOfPages) {
				d.fail(desc, fmt.Errorf("got %v, want ErrOutOfPages", err))
			}
		case err != nil:
			d.fail(desc, err)
		default:
			pick.reserved = target - pick.n
		}
	case 3: // Commit
		if pick == nil {
			return
		}
		n := x % (pick.reserved + 2)
		desc = fmt.Sprintf("Commit(seq %d, %d)", pick.s.ID(), n)
		err := p.Commit(pick.s, n)
		d.outcome("Commit", err)
		if n > pick.reserved {
			if !errors.Is(err, ErrNotReserved) {
				d.fail(desc, fmt.Errorf("got %v, want ErrNotReserved", err))
			}
		} else if err != nil {
			d.fail(desc, err)
		} else {
			pick.n += n
			pick.reserved -= n
		}
	case 4: // Truncate
		if pick == nil {
			return
		}
		foot := pick.n + pick.reserved
		n := x % (foot + 2)
		desc = fmt.Sprintf("Truncate(seq %d, %d)", pick.s.ID(), n)
		err := p.Truncate(pick.s, n)
		d.outcome("Truncate", err)
		switch {
		case n > foot:
			if err == nil {
				d.fail(desc, errors.New("truncating beyond the footprint succeeded"))
			}
		case err != nil:
			d.fail(desc, err)
		case n <= pick.n:
			pick.n, pick.reserved = n, 0
		default:
			pick.reserved = n - pick.n
		}
	case 5: // Release, or poke a released sequence
		if len(d.dead) > 0 && x%4 == 0 {
			s := d.dead[x%len(d.dead)]
			desc = fmt.Sprintf("Release(released seq %d)", s.ID())
			err := p.Release(s)
			d.outcome("Release", err)
			if !errors.Is(err, ErrReleased) {
				d.fail(desc, fmt.Errorf("got %v, want ErrReleased", err))
			}
			if err := p.Reserve(s, 1); !errors.Is(err, ErrReleased) {
				d.fail(desc, fmt.Errorf("Reserve: got %v, want ErrReleased", err))
			}
			break
		}
		if pick == nil {
			return
		}
		desc = fmt.Sprintf("Release(seq %d)", pick.s.ID())
		err := p.Release(pick.s)
		d.outcome("Release", err)
		if err != nil {
			d.fail(desc, err)
		}
		id := pick.s.ID()
		delete(d.live, id)
		d.order = slices.DeleteFunc(d.order, func(v uint64) bool { return v == id })
		d.dead = append(d.dead, pick.s)
		if len(d.dead) > 8 {
			d.dead = d.dead[1:]
		}
	}
	d.verify(desc)
}

// outcome records the class of err for the coverage assertion.
func (d *driver) outcome(op string, err error) {
	for _, e := range []error{ErrDuplicateSeq, ErrNoRow, ErrContextFull, ErrOutOfPages, ErrNotReserved, ErrReleased} {
		if errors.Is(err, e) {
			d.hits[op+": "+e.Error()]++
			return
		}
	}
	if err != nil {
		d.hits[op+": error"]++
	} else {
		d.hits[op]++
	}
}

func (d *driver) verify(desc string) {
	d.t.Helper()
	p, c := d.p, d.cfg
	if err := p.Check(); err != nil {
		d.fail(desc, err)
	}
	if p.Live() != len(d.live) {
		d.fail(desc, fmt.Errorf("Live %d, model %d", p.Live(), len(d.live)))
	}
	if want := c.Pages - d.usedPages(); p.FreePages() != want {
		d.fail(desc, fmt.Errorf("FreePages %d, model %d", p.FreePages(), want))
	}
	for _, id := range d.order {
		m := d.live[id]
		if m.s.Len() != m.n || m.s.Reserved() != m.reserved {
			d.fail(desc, fmt.Errorf("seq %d len %d reserved %d, model %d %d", id, m.s.Len(), m.s.Reserved(), m.n, m.reserved))
		}
		if sl := m.s.Slots(); !slices.Equal(sl, wantSlots(m.s.Pages(), c.PageSize, m.n+m.reserved)) {
			d.fail(desc, fmt.Errorf("seq %d slots %v, pages %v", id, sl, m.s.Pages()))
		}
	}
}

// TestRandomInterleaving drives NewSeq/Reserve/Commit/Truncate/Release in a
// seeded random order over several pool shapes, keeping Check clean and the
// pool in step with a plain model.
func TestRandomInterleaving(t *testing.T) {
	for _, c := range []Config{
		{Layers: 1, KVDim: 1, PageSize: 1, Pages: 24, MaxSeqs: 5, MaxContext: 20},
		{Layers: 1, KVDim: 1, PageSize: 3, Pages: 13, MaxSeqs: 4, MaxContext: 30},
		{Layers: 1, KVDim: 1, PageSize: 16, Pages: 9, MaxSeqs: 6, MaxContext: 100},
	} {
		for seed := range uint64(3) {
			t.Run(fmt.Sprintf("page%d/seed%d", c.PageSize, seed), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(seed, 99))
				d := newDriver(t, c)
				for range 3000 {
					d.step(rng.IntN(6), rng.IntN(1<<20))
				}
				for _, want := range []string{
					"NewSeq", "NewSeq: " + ErrDuplicateSeq.Error(), "NewSeq: " + ErrNoRow.Error(),
					"Reserve", "Reserve: " + ErrContextFull.Error(), "Reserve: " + ErrOutOfPages.Error(),
					"Commit", "Commit: " + ErrNotReserved.Error(), "Truncate", "Truncate: error",
					"Release", "Release: " + ErrReleased.Error(),
				} {
					if d.hits[want] == 0 {
						t.Errorf("outcome %q never happened: %v", want, d.hits)
					}
				}
				// Releasing everything returns every page and row.
				for _, id := range slices.Clone(d.order) {
					if err := d.p.Release(d.live[id].s); err != nil {
						t.Fatal(err)
					}
				}
				if d.p.FreePages() != c.Pages || d.p.Live() != 0 {
					t.Fatalf("after releasing all: %d free of %d, %d live", d.p.FreePages(), c.Pages, d.p.Live())
				}
				mustCheck(t, d.p)
			})
		}
	}
}

// FuzzPoolOps reads pairs of bytes as (operation, argument).
func FuzzPoolOps(f *testing.F) {
	f.Add([]byte{0, 0, 1, 7, 3, 3, 4, 1, 5, 0})
	f.Add([]byte{0, 0, 0, 1, 1, 200, 2, 33, 0, 2, 1, 9, 5, 0, 5, 4, 4, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		d := newDriver(t, Config{Layers: 1, KVDim: 1, PageSize: 3, Pages: 10, MaxSeqs: 3, MaxContext: 24})
		for i := 0; i+1 < len(ops); i += 2 {
			d.step(int(ops[i]), int(ops[i+1]))
		}
	})
}
