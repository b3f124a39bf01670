package abtest

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Cell is one cell of the matrix: the workload run once under one
// index-K precision and HiCache state, every output compared with its
// precision's reference.
type Cell struct {
	IndexK  string `json:"index_k"` // fp8 or bf16
	HiCache string `json:"hicache"` // on or off
	// Requests were sent; Compared ended with an output, and Corrupt of
	// those differ from their reference (text or token count).
	Requests     int     `json:"requests"`
	Compared     int     `json:"compared"`
	Corrupt      int     `json:"corrupt"`
	CorruptShare float64 `json:"corrupt_share"` // Corrupt / Compared
	// Timeouts ran out of their time (the client's or the server's);
	// Errors ended otherwise without an output, ErrorKinds by class.
	Timeouts   int            `json:"timeouts"`
	Errors     int            `json:"errors"`
	ErrorKinds map[string]int `json:"error_kinds,omitempty"`
	// FirstCorrupt and FirstError name the first of each, by conversation
	// and turn (from 1).
	FirstCorrupt string `json:"first_corrupt,omitempty"`
	FirstError   string `json:"first_error,omitempty"`
	// TTFT is time to first output, ITL the time between two streamed
	// outputs, in milliseconds, over the requests that ended with one.
	TTFTMS Percentiles `json:"ttft_ms"`
	ITLMS  Percentiles `json:"itl_ms"`
	// HostHits and HitTokens are the requests whose prefix came (partly)
	// back from the host tier during the cell and the tokens so loaded,
	// summed over the servers (each server's rank 0: its ranks agree).
	HostHits  uint64 `json:"host_hits"`
	HitTokens uint64 `json:"hit_tokens"`
	// Seconds is the cell's run, switches not included.
	Seconds float64 `json:"seconds"`
}

// Percentiles are a latency's median and 99th percentile.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P99 float64 `json:"p99"`
}

// Compare fills a cell's counts and latencies from its outcomes and their
// references (both conversation → turn).
func Compare(cell Cell, outs, refs [][]Outcome) Cell {
	var ttft, itl []time.Duration
	cell.ErrorKinds = nil
	for ci, conv := range outs {
		for t, o := range conv {
			cell.Requests++
			where := fmt.Sprintf("conversation %d turn %d", ci+1, t+1)
			switch {
			case o.Timeout:
				cell.Timeouts++
				if cell.FirstError == "" {
					cell.FirstError = where + ": timed out: " + o.Err
				}
				continue
			case o.Kind != "":
				cell.Errors++
				if cell.ErrorKinds == nil {
					cell.ErrorKinds = map[string]int{}
				}
				cell.ErrorKinds[o.Kind]++
				if cell.FirstError == "" {
					cell.FirstError = where + ": " + o.Err
				}
				continue
			}
			cell.Compared++
			ttft = append(ttft, o.TTFT)
			itl = append(itl, o.Gaps...)
			if ref := refs[ci][t]; o.Text != ref.Text || o.Tokens != ref.Tokens {
				cell.Corrupt++
				if cell.FirstCorrupt == "" {
					cell.FirstCorrupt = where
				}
			}
		}
	}
	if cell.Compared > 0 {
		cell.CorruptShare = float64(cell.Corrupt) / float64(cell.Compared)
	}
	cell.TTFTMS, cell.ITLMS = percentiles(ttft), percentiles(itl)
	return cell
}

// percentiles are the nearest-rank p50 and p99 of ds in milliseconds.
func percentiles(ds []time.Duration) Percentiles {
	if len(ds) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	at := func(q float64) float64 {
		i := max(int(math.Ceil(q*float64(len(s))))-1, 0)
		return float64(s[i]) / float64(time.Millisecond)
	}
	return Percentiles{P50: at(0.50), P99: at(0.99)}
}
