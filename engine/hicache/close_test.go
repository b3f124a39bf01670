package hicache

import (
	"errors"
	"testing"

	"github.com/pdkit/pdkit/internal/procstat"
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

// residentBytes is this process's resident set.
func residentBytes(t *testing.T) int64 {
	n, err := procstat.Resident(0)
	if err != nil {
		t.Skipf("no resident set to read here: %v", err)
	}
	return n
}
