// Package membw measures how fast this machine streams memory into a core:
// the bound a decode step, which reads every weight once, cannot beat. It
// reads with the widest plain loads the CPU has and does no arithmetic
// worth the name, so the figure is the memory system's, not a kernel's.
package membw

import (
	"slices"
	"sync"
	"time"
)

// block is the bytes one call of the reader's inner loop reads.
const block = 256

// Read returns the bytes per second of reading a buffer of about bytes
// bytes (rounded down to whole blocks per thread) sequentially, split into
// threads contiguous parts read at once, as the median of repeats passes
// after one that faults the pages in. A buffer far larger than the
// last-level cache measures DRAM.
func Read(bytes, threads, repeats int) float64 {
	threads = max(threads, 1)
	per := max(bytes/threads/block, 1) * block
	buf := make([]byte, per*threads)
	for i := 0; i < len(buf); i += 4096 {
		buf[i] = byte(i)
	}
	pass := func() time.Duration {
		var wg sync.WaitGroup
		start := time.Now()
		for t := range threads {
			part := buf[t*per : (t+1)*per]
			wg.Go(func() { sink.Add(readBlocks(part)) })
		}
		wg.Wait()
		return time.Since(start)
	}
	pass()
	var runs []float64
	for range max(repeats, 1) {
		runs = append(runs, float64(len(buf))/pass().Seconds())
	}
	slices.Sort(runs)
	return runs[len(runs)/2]
}
