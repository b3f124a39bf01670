package sample

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestGreedyTiesAndNaN(t *testing.T) {
	nan := float32(math.NaN())
	cases := []struct {
		in   []float32
		want int32
	}{
		{[]float32{1, 3, 3, 2}, 1},
		{[]float32{nan, -5, -1}, 2},
		{[]float32{nan, nan}, 0},
		{[]float32{-1}, 0},
	}
	for _, c := range cases {
		if got := Greedy(c.in); got != c.want {
			t.Errorf("Greedy(%v) = %d, want %d", c.in, got, c.want)
		}
	}
}

func TestSampleSeededAndDistribution(t *testing.T) {
	logits := []float32{0, float32(math.Log(3)), -100}
	a, b := New(Params{Temperature: 1, Seed: 7}), New(Params{Temperature: 1, Seed: 7})
	counts := make([]int, 3)
	const n = 20000
	for range n {
		x, y := a.Sample(logits), b.Sample(logits)
		if x != y {
			t.Fatal("same seed drew different tokens")
		}
		counts[x]++
	}
	// p = 1/4, 3/4, ~0; allow 4 standard deviations.
	if d := math.Abs(float64(counts[1])/n - 0.75); d > 4*math.Sqrt(0.75*0.25/n) {
		t.Errorf("token 1 drawn %d/%d times, want about 3/4", counts[1], n)
	}
	if counts[2] != 0 {
		t.Errorf("token with p≈e^-100 drawn %d times", counts[2])
	}
}

func TestTopPKeepsNucleus(t *testing.T) {
	logits := []float32{2, 1, 0, -1}
	s := New(Params{Temperature: 1, TopP: 0.5, Seed: 1})
	for range 1000 {
		if got := s.Sample(logits); got != 0 {
			t.Fatalf("top_p 0.5 drew token %d; only token 0 (p≈0.64) is in the nucleus", got)
		}
	}
}

func TestValidate(t *testing.T) {
	bad := []Params{{Temperature: -1}, {TopP: 1.5}, {Temperature: float32(math.NaN())}, {TopP: -0.1}}
	for _, p := range bad {
		if p.Validate() == nil {
			t.Errorf("%+v accepted", p)
		}
	}
	if err := (Params{Temperature: 0.7, TopP: 0.9}).Validate(); err != nil {
		t.Error(err)
	}
}

// TestGreedyMatchesReference checks the vector Greedy against the plain
// one on seeded logits of every length around the vector blocks, with
// ties, NaNs and infinities planted.
func TestGreedyMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	for n := 1; n <= 300; n++ {
		for trial := range 20 {
			x := make([]float32, n)
			for i := range x {
				x[i] = float32(rng.NormFloat64())
			}
			switch trial % 5 {
			case 1: // a tie for the maximum, late then early
				x[rng.IntN(n)], x[rng.IntN(n)] = 9, 9
			case 2: // NaNs everywhere, one of them at the maximum's place
				for i := range x {
					if rng.IntN(3) == 0 {
						x[i] = nan
					}
				}
			case 3: // only NaN and −Inf
				for i := range x {
					x[i] = nan
					if rng.IntN(4) == 0 {
						x[i] = -inf
					}
				}
			case 4:
				x[rng.IntN(n)] = inf
			}
			if got, want := Greedy(x), greedyGo(x); got != want {
				t.Fatalf("n %d trial %d: Greedy = %d, plain Go = %d (%v)", n, trial, got, want, x)
			}
		}
	}
	all := make([]float32, 1000)
	for i := range all {
		all[i] = nan
	}
	if got := Greedy(all); got != 0 {
		t.Fatalf("all NaN: Greedy = %d, want 0", got)
	}
}

func BenchmarkGreedy(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	x := make([]float32, 32000)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	b.Run("vector", func(b *testing.B) {
		for b.Loop() {
			Greedy(x)
		}
	})
	b.Run("plain", func(b *testing.B) {
		for b.Loop() {
			greedyGo(x)
		}
	})
}
