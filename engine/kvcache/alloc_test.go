package kvcache

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestAllocatorMatchesModel runs a seeded random sequence of Alloc/Free calls
// against a map of owned pages and checks counts, ownership and Check after
// every call.
func TestAllocatorMatchesModel(t *testing.T) {
	const total, ops, seed = 97, 10000, 1
	rng := rand.New(rand.NewPCG(seed, 2))
	a := NewPageAllocator(total)
	owned := map[int32]bool{}
	var held [][]int32 // allocations not yet freed
	for i := range ops {
		if rng.IntN(2) == 0 || len(held) == 0 {
			n := rng.IntN(12)
			pages, err := a.Alloc(n)
			if n > total-len(owned) {
				if !errors.Is(err, ErrOutOfPages) {
					t.Fatalf("op %d: Alloc(%d) with %d free: err %v, want ErrOutOfPages", i, n, total-len(owned), err)
				}
				if pages != nil {
					t.Fatalf("op %d: failed Alloc returned pages %v", i, pages)
				}
			} else {
				if err != nil {
					t.Fatalf("op %d: Alloc(%d) with %d free: %v", i, n, total-len(owned), err)
				}
				if len(pages) != n {
					t.Fatalf("op %d: Alloc(%d) gave %d pages", i, n, len(pages))
				}
				for _, p := range pages {
					if p < 0 || p >= total || owned[p] {
						t.Fatalf("op %d: Alloc gave page %d, already owned or out of range", i, p)
					}
					owned[p] = true
				}
				if n > 0 {
					held = append(held, pages)
				}
			}
		} else {
			j := rng.IntN(len(held))
			pages := held[j]
			// Sometimes free only part of an allocation.
			if len(pages) > 1 && rng.IntN(3) == 0 {
				k := 1 + rng.IntN(len(pages)-1)
				held[j] = pages[k:]
				pages = pages[:k]
			} else {
				held = slices.Delete(held, j, j+1)
			}
			if err := a.Free(pages); err != nil {
				t.Fatalf("op %d: Free(%v): %v", i, pages, err)
			}
			for _, p := range pages {
				delete(owned, p)
			}
		}
		if a.UsedCount() != len(owned) || a.FreeCount() != total-len(owned) || a.Total() != total {
			t.Fatalf("op %d: used %d free %d total %d, model owns %d of %d", i, a.UsedCount(), a.FreeCount(), a.Total(), len(owned), total)
		}
		if err := a.Check(); err != nil {
			t.Fatalf("op %d: %v", i, err)
		}
	}
}

func TestAllocatorDoubleFreeChangesNothing(t *testing.T) {
	a := NewPageAllocator(8)
	pages, err := a.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Free(pages[:1]); err != nil {
		t.Fatal(err)
	}
	before := snapshot(a)
	for _, tc := range []struct {
		name  string
		pages []int32
		want  error
		page  string
	}{
		{"freed page", []int32{pages[1], pages[0]}, ErrDoubleFree, "page 0 "},
		{"never allocated", []int32{pages[2], 7}, ErrDoubleFree, "page 7 "},
		{"listed twice", []int32{pages[1], pages[2], pages[1]}, ErrDoubleFree, "page 1 "},
		{"out of range", []int32{pages[3], 8}, ErrBadPage, "page 8 "},
		{"negative", []int32{-1}, ErrBadPage, "page -1 "},
	} {
		err := a.Free(tc.pages)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: Free(%v) = %v, want %v", tc.name, tc.pages, err, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.page) {
			t.Errorf("%s: error %q does not name %q", tc.name, err, tc.page)
		}
		if got := snapshot(a); !slices.Equal(got, before) {
			t.Errorf("%s: failed Free changed the allocator: %v, was %v", tc.name, got, before)
		}
		if err := a.Check(); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	if a.FreeCount() != 5 || a.UsedCount() != 3 {
		t.Fatalf("free %d used %d, want 5 and 3", a.FreeCount(), a.UsedCount())
	}
	// The rest still frees normally, once.
	if err := a.Free(pages[1:]); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(pages[1:2]); !errors.Is(err, ErrDoubleFree) {
		t.Fatalf("second Free: %v, want ErrDoubleFree", err)
	}
}

// snapshot is the allocator's observable state: what the next Alloc of
// everything would hand out, plus the counts.
func snapshot(a *PageAllocator) []int32 {
	s := slices.Clone(a.free)
	return append(s, int32(a.FreeCount()), int32(a.UsedCount()))
}

func TestAllocatorOutOfPagesChangesNothing(t *testing.T) {
	a := NewPageAllocator(5)
	if _, err := a.Alloc(3); err != nil {
		t.Fatal(err)
	}
	before := snapshot(a)
	pages, err := a.Alloc(3)
	if !errors.Is(err, ErrOutOfPages) || pages != nil {
		t.Fatalf("Alloc(3) with 2 free = %v, %v; want nil, ErrOutOfPages", pages, err)
	}
	if msg := err.Error(); !strings.Contains(msg, "want 3") || !strings.Contains(msg, "2 of 5 free") {
		t.Errorf("error %q does not say how many were wanted and free", msg)
	}
	if got := snapshot(a); !slices.Equal(got, before) {
		t.Fatalf("failed Alloc changed the allocator")
	}
	if pages, err := a.Alloc(0); pages != nil || err != nil {
		t.Fatalf("Alloc(0) = %v, %v", pages, err)
	}
	if _, err := a.Alloc(-1); err == nil {
		t.Fatal("Alloc(-1) succeeded")
	}
}

func TestAllocatorDeterministic(t *testing.T) {
	run := func() [][]int32 {
		rng := rand.New(rand.NewPCG(7, 7))
		a := NewPageAllocator(64)
		var held, out [][]int32
		for range 2000 {
			if rng.IntN(2) == 0 || len(held) == 0 {
				p, err := a.Alloc(rng.IntN(5))
				if err == nil && len(p) > 0 {
					held = append(held, p)
					out = append(out, p)
				}
			} else {
				j := rng.IntN(len(held))
				if err := a.Free(held[j]); err != nil {
					t.Fatal(err)
				}
				held = slices.Delete(held, j, j+1)
			}
		}
		return out
	}
	a, b := run(), run()
	if !slices.EqualFunc(a, b, slices.Equal) {
		t.Fatal("same calls gave different pages")
	}
	// A fresh allocator starts from the lowest pages; Free then Alloc of the
	// same count gives the same pages back in the same order.
	al := NewPageAllocator(10)
	p, _ := al.Alloc(3)
	if !slices.Equal(p, []int32{0, 1, 2}) {
		t.Fatalf("fresh Alloc(3) = %v", p)
	}
	q, _ := al.Alloc(2)
	if err := al.Free(q); err != nil {
		t.Fatal(err)
	}
	if r, _ := al.Alloc(2); !slices.Equal(r, q) {
		t.Fatalf("realloc gave %v, freed %v", r, q)
	}
}

func TestAllocatorCheckCatchesCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(a *PageAllocator)
	}{
		{"page on free stack twice", func(a *PageAllocator) {
			a.free = append(a.free, a.free[0])
			a.freeCount.Add(1)
		}},
		{"allocated page on free stack", func(a *PageAllocator) {
			a.free = append(a.free, 0)
			a.freeCount.Add(1)
		}},
		{"free page lost", func(a *PageAllocator) {
			a.free = a.free[:len(a.free)-1]
			a.freeCount.Add(-1)
		}},
		{"count drift", func(a *PageAllocator) { a.freeCount.Add(1) }},
	} {
		a := NewPageAllocator(6)
		if _, err := a.Alloc(2); err != nil {
			t.Fatal(err)
		}
		tc.corrupt(a)
		if err := a.Check(); err == nil {
			t.Errorf("%s: Check found nothing", tc.name)
		}
	}
}
