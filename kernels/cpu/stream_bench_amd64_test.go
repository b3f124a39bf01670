//go:build amd64

package cpu

import (
	"fmt"
	"testing"
	"time"

	"github.com/pdkit/pdkit/internal/membw"
	"github.com/pdkit/pdkit/kernels"
)

// streamBytes is the size of the matrices BenchmarkGEMVStream streams: far
// larger than L3 (32 MiB), so that every call reads DRAM.
const streamBytes = 1 << 30

// BenchmarkGEMVStream measures how fast decode (one x row) streams weights
// from DRAM: the GB/s of the 1×8 kernel over a 1 GiB matrix with the row
// lengths of the medium model (768 and 2048 columns) and of pdserve bench's
// bandwidth probe (1024), next to plain loads of a buffer as large
// (internal/membw), the bound. GB/s-noprefetch is the same kernel without the
// software prefetch, each call alternating with one with it; GB/s-1x8 is
// the 1×8 kernel called panel by panel from Go (the path before
// dot1x8F32S and its twins, with the prefetch), alternating too.
// PD_STREAM_AHEAD sets the prefetch distance in rows.
func BenchmarkGEMVStream(b *testing.B) {
	setFromEnv(b, "PD_STREAM_AHEAD", &streamAhead)
	b.Run("membw/threads=1", func(b *testing.B) {
		var gbs float64
		for b.Loop() {
			gbs = membw.Read(streamBytes, 1, 3) / 1e9
		}
		b.ReportMetric(gbs, "GB/s")
	})
	for _, d := range []kernels.DType{kernels.F32, kernels.F16} {
		for _, k := range []int{768, 1024, 2048} {
			w := streamMatrix(d, k)
			x := make([]float32, k)
			for i := range x {
				x[i] = float32(i%5) * 0.5
			}
			dst := make([]float32, w.Rows)
			be := New(1)
			be.MatMul(dst, x, w, 1) // fault the pages in
			panels := New(1)
			kp := *panels.k
			kp.dot1x8S = [4]dot1x8SFunc{}
			panels.k = &kp
			b.Run(fmt.Sprintf("%v/k=%d", d, k), func(b *testing.B) {
				// Calls with and without the prefetch alternate, so that
				// both see the same memory system; the ratio is theirs.
				var on, off, old time.Duration
				for b.Loop() {
					t0 := time.Now()
					be.MatMul(dst, x, w, 1)
					t1 := time.Now()
					saved := streamAhead
					streamAhead = 0
					be.MatMul(dst, x, w, 1)
					streamAhead = saved
					t2 := time.Now()
					panels.MatMul(dst, x, w, 1)
					on, off, old = on+t1.Sub(t0), off+t2.Sub(t1), old+time.Since(t2)
				}
				gb := float64(len(w.Data)) * float64(b.N) / 1e9
				b.ReportMetric(gb/on.Seconds(), "GB/s")
				b.ReportMetric(gb/off.Seconds(), "GB/s-noprefetch")
				b.ReportMetric(off.Seconds()/on.Seconds(), "speedup")
				b.ReportMetric(gb/old.Seconds(), "GB/s-1x8")
				b.ReportMetric(old.Seconds()/on.Seconds(), "speedup-1x8")
			})
			be.Close()
			panels.Close()
		}
	}
}

// streamMatrix is a matrix of about streamBytes bytes of k columns; its
// values do not matter to the speed.
func streamMatrix(d kernels.DType, k int) *kernels.Matrix {
	rb, err := kernels.RowBytes(d, k)
	if err != nil {
		panic(err)
	}
	n := streamBytes / rb &^ 7
	data := make([]byte, n*rb)
	for i := 0; i < len(data); i += 2 {
		data[i+1] = 0x3c // 1.0 in F16 high bytes; small F32 values
	}
	w, err := kernels.NewMatrix(d, n, k, data)
	if err != nil {
		panic(err)
	}
	return w
}
