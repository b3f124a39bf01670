package cpu

import (
	"testing"
)

func BenchmarkPool(b *testing.B) {
	p := newPool(2)
	defer p.close()
	var sink [2]int
	b.Run("2parts", func(b *testing.B) {
		for b.Loop() {
			p.run(2, func(i int) { sink[i]++ })
		}
	})
	b.Run("8parts", func(b *testing.B) {
		for b.Loop() {
			p.run(8, func(i int) { sink[i%2]++ })
		}
	})
}
