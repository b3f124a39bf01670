package tui

import (
	"github.com/pdkit/pdkit/diag"
)

// historyLen is how many step rates History keeps per rank: at the
// default 1s interval, the last 20 seconds.
const historyLen = 20

// rankKey names one rank of one server.
type rankKey struct {
	url  string
	rank int
}

// History keeps, for every rank of every server sampled, its step rate
// (steps per second) between each two samples, the last few only: the
// ranks panel draws it as a sparkline, so that the moment ranks part
// shows. It is fed every sample in order (Add) and keeps no samples.
type History struct {
	n     int
	last  map[rankKey]stepAt
	rates map[rankKey][]float64 // oldest first, at most n
}

// stepAt is a rank's step at the time of a sample.
type stepAt struct {
	step  uint64
	taken int64 // unix nanoseconds
}

// NewHistory returns a history keeping n rates per rank (historyLen when n
// is not positive).
func NewHistory(n int) *History {
	if n <= 0 {
		n = historyLen
	}
	return &History{n: n, last: map[rankKey]stepAt{}, rates: map[rankKey][]float64{}}
}

// Len is how many rates History keeps per rank.
func (h *History) Len() int { return h.n }

// Add takes the step of every rank of s against its previous sample's. A
// server not read leaves its ranks' histories as they were; a step lower
// than before (the server restarted) starts the rank's history again.
func (h *History) Add(s diag.Sample) {
	t := s.Taken.UnixNano()
	for _, sv := range s.Servers {
		if !sv.Reachable || sv.Steps == nil {
			continue
		}
		for _, r := range sv.Steps.Ranks {
			k := rankKey{sv.URL, r.Rank}
			prev, ok := h.last[k]
			h.last[k] = stepAt{r.Step, t}
			switch {
			case !ok || t <= prev.taken:
				continue
			case r.Step < prev.step:
				delete(h.rates, k)
				continue
			}
			rate := float64(r.Step-prev.step) / (float64(t-prev.taken) / 1e9)
			rs := append(h.rates[k], rate)
			if len(rs) > h.n {
				rs = rs[len(rs)-h.n:]
			}
			h.rates[k] = rs
		}
	}
}

// Rates is the rank's step rates, oldest first; nil before two samples.
func (h *History) Rates(url string, rank int) []float64 {
	if h == nil {
		return nil
	}
	return h.rates[rankKey{url, rank}]
}

// historyOf builds the history of a window of samples, for a frame drawn
// without a model's (a one-shot render, a test).
func historyOf(window []Sample) *History {
	h := NewHistory(0)
	for _, s := range window {
		h.Add(s.Sample)
	}
	return h
}

// sparkBlocks draw a rate relative to the highest of its group; a rate of
// zero is "·", so a stopped rank reads apart from a slow one.
var sparkBlocks = []rune("▁▂▃▄▅▆▇█")

// sparkline draws the last width rates scaled to top, right-aligned (the
// newest at the right edge, spaces before the first).
func sparkline(rates []float64, width int, top float64) string {
	if len(rates) > width {
		rates = rates[len(rates)-width:]
	}
	out := make([]rune, 0, width)
	for range width - len(rates) {
		out = append(out, ' ')
	}
	for _, r := range rates {
		if r <= 0 || top <= 0 {
			out = append(out, '·')
			continue
		}
		i := int(r / top * float64(len(sparkBlocks)))
		out = append(out, sparkBlocks[min(max(i, 0), len(sparkBlocks)-1)])
	}
	return string(out)
}
