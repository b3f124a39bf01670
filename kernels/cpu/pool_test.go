package cpu

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/waitfor"
)

func TestPoolRunsEveryPart(t *testing.T) {
	p := newPool(3)
	defer p.close()
	for _, parts := range []int{0, 1, 2, 3, 7, 100} {
		hits := make([]atomic.Int32, parts)
		p.run(parts, func(i int) { hits[i].Add(1) })
		for i := range hits {
			if n := hits[i].Load(); n != 1 {
				t.Fatalf("parts=%d: part %d ran %d times", parts, i, n)
			}
		}
	}
}

func TestPoolPanic(t *testing.T) {
	p := newPool(2)
	defer p.close()
	defer func() {
		r := recover()
		if s, _ := r.(string); !strings.Contains(s, "boom") {
			t.Fatalf("recovered %v, want the part's panic", r)
		}
	}()
	p.run(4, func(i int) {
		if i == 2 {
			panic("boom")
		}
	})
	t.Fatal("run returned after a part panicked")
}

// TestClose: Close stops every worker, is idempotent, and the backend still
// computes afterwards (on the calling goroutine).
func TestClose(t *testing.T) {
	before := runtime.NumGoroutine()
	b := New(4)
	b.minWork = 1
	x := randVec(newTestRand(), 1001, 4)
	dst, want := make([]float32, 1000), make([]float32, 1000)
	b.SwiGLU(dst, x[:1000], x[1:]) // split over the workers
	b.Close()
	b.Close()
	waitGoroutines(t, before)
	b.SwiGLU(dst, x[:1000], x[1:])
	b1 := New(1)
	defer b1.Close()
	b1.SwiGLU(want, x[:1000], x[1:])
	for i := range want {
		if dst[i] != want[i] {
			t.Fatalf("after Close: SwiGLU[%d] = %v, want %v", i, dst[i], want[i])
		}
	}
	if b.Threads() != 4 {
		t.Fatalf("Threads() = %d, want 4", b.Threads())
	}
}

// TestCleanup: a Backend dropped without Close lets its workers go.
func TestCleanup(t *testing.T) {
	before := runtime.NumGoroutine()
	func() {
		b := New(3)
		b.minWork = 1
		x := randVec(newTestRand(), 1001, 4)
		b.SwiGLU(make([]float32, 1000), x[:1000], x[1:])
	}()
	// The workers end once the pool is collected: collect on each try.
	waitfor.NoError(t, "the workers ending", 5*time.Second, func() error {
		runtime.GC()
		return goroutinesAtMost(before)
	})
}

func waitGoroutines(t *testing.T, want int) {
	t.Helper()
	waitfor.NoError(t, "the workers ending", 5*time.Second, func() error { return goroutinesAtMost(want) })
}

func goroutinesAtMost(want int) error {
	if n := runtime.NumGoroutine(); n > want {
		return fmt.Errorf("%d goroutines, want %d", n, want)
	}
	return nil
}

func newTestRand() *rand.Rand { return rand.New(rand.NewPCG(42, 42)) }
