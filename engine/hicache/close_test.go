package hicache

import (
	"bufio"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

// Close refuses while the pool's loader is open, since it copies off the
// caller's goroutine; then it gives the memory back, pins and all, and
// refuses every later backup, load, loader and writer.
func TestCloseAfterLastCopier(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexFP8), 8, 0)
	r.backupNew(1, 3)
	before := MappedBytes()
	if !r.host.Pin(1) {
		t.Fatal("pin of a backed-up key refused")
	}
	if err := r.host.Close(); err == nil {
		t.Fatal("close with the loader open")
	}
	if MappedBytes() != before {
		t.Fatal("a refused close unmapped the pool")
	}
	r.ld.Close()
	if err := r.host.Close(); err != nil {
		t.Fatal(err)
	}
	if got := before - MappedBytes(); got != r.host.Bytes() {
		t.Fatalf("close gave back %d bytes, pool has %d", got, r.host.Bytes())
	}
	if _, err := r.host.Backup(2, r.dev, r.newSeq(3, true).Pages()); !errors.Is(err, ErrPoolClosed) {
		t.Fatalf("backup on a closed pool: %v", err)
	}
	if r.host.Pin(1) || r.host.Has(1) {
		t.Fatal("a closed pool still has key 1")
	}
	if _, err := NewLoader(r.host, r.dev, 0); !errors.Is(err, ErrPoolClosed) {
		t.Fatalf("a loader on a closed pool: %v", err)
	}
	if _, err := NewWriter(r.host, r.dev); !errors.Is(err, ErrPoolClosed) {
		t.Fatalf("a writer on a closed pool: %v", err)
	}
	if err := r.host.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if err := r.host.Check(); err != nil {
		t.Fatal(err)
	}
}

// A closed pool's memory leaves the process at once: the resident set
// shrinks by the pool's size, with no garbage collection in between.
func TestCloseReturnsMemoryToTheOS(t *testing.T) {
	c := devConfig(kernels.IndexFP8)
	l, err := LayoutOf(c)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	h, err := NewHostPool(c, size/l.PageBytes, size)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(h.mem); i += 4096 {
		h.mem[i] = 1 // make every page resident, as a full tier would
	}
	full := residentBytes(t)
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if freed := full - residentBytes(t); freed < size*9/10 {
		t.Fatalf("closing a %d MiB pool took %d KiB off the resident set", size>>20, freed>>10)
	}
}

// residentBytes is the process's resident set (VmRSS).
func residentBytes(t *testing.T) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		t.Skipf("no resident set to read here: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// Close refuses while a Writer on the pool is open, or while a Backup is
// copying into an entry.
func TestCloseWaitsForWriters(t *testing.T) {
	r := newRig(t, devConfig(kernels.IndexBF16), 8, 0)
	r.ld.Close()
	w, err := NewWriter(r.host, r.dev)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.host.Close(); err == nil {
		t.Fatal("close with a writer open")
	}
	w.Close()
	if _, _, err := r.host.reserve(1, 2); err != nil { // as Backup does before it copies
		t.Fatal(err)
	}
	if err := r.host.Close(); !errors.Is(err, ErrPinned) {
		t.Fatalf("close while an entry is being written: %v", err)
	}
}
