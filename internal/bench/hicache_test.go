package bench

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/kernels"
)

// TestRunHiCacheTiny runs `pdserve bench hicache` end to end on the tiny
// model with the fault off only (the fault-on cells are a data race by
// design and never run under -race): every output equals its reference,
// prefixes really went to the host tier and came back, with the loader
// unpaced and paced, and the speed part measured host hits against
// recompute. It checks the structure of the figures, never their speed.
func TestRunHiCacheTiny(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	cfg := HiCacheConfig{
		Home: t.TempDir(), Size: builtin.SizeTiny, Threads: 1,
		Sessions: 12, RequestsPerCell: 96, MaxRunning: 2,
		Precisions:     []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16},
		LoadBandwidths: []int64{0, 64 << 20},
		Prefix:         64, SpeedSessions: 3, SpeedTurns: 2,
	}
	rep, err := RunHiCache(ctx, cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Cells) != 4 {
		t.Fatalf("%d cells, want 4 (2 precisions × 2 pacings, fault off)", len(rep.Cells))
	}
	for _, c := range rep.Cells {
		if c.Fault || len(c.Runs) != 1 {
			t.Errorf("%v at %d B/s: fault %v, %d runs; want the fault off, 1 run", c.IndexK, c.LoadBandwidth, c.Fault, len(c.Runs))
			continue
		}
		r := c.Runs[0]
		if r.Requests != cfg.RequestsPerCell || r.Compared != r.Requests || r.Timeouts != 0 || r.Errors != 0 {
			t.Errorf("%v at %d B/s: %d requests, %d compared, %d timeouts, %d errors %v", c.IndexK, c.LoadBandwidth, r.Requests, r.Compared, r.Timeouts, r.Errors, r.ErrorKind)
		}
		if r.Differ != 0 {
			t.Errorf("%v at %d B/s: %d outputs differ from their references with the fault off (first: %s)", c.IndexK, c.LoadBandwidth, r.Differ, r.FirstDiffer)
		}
		if r.HostHits == 0 || r.HitTokens == 0 || r.Loads == 0 || r.Steps == 0 {
			t.Errorf("%v at %d B/s: no prefix came back from host: %+v", c.IndexK, c.LoadBandwidth, r)
		}
	}
	if rep.FaultOffDiffer() != 0 {
		t.Errorf("FaultOffDiffer %d", rep.FaultOffDiffer())
	}
	sp := rep.Speed
	if sp == nil {
		t.Fatal("no speed part")
	}
	if sp.Measured != cfg.SpeedSessions*cfg.SpeedTurns || sp.Hits == 0 || sp.HitTokens == 0 {
		t.Errorf("speed: %d measured turns (want %d), %d host hits loading %.0f tokens each", sp.Measured, cfg.SpeedSessions*cfg.SpeedTurns, sp.Hits, sp.HitTokens)
	}
	if !(sp.HitP50 > 0 && sp.RecomputeP50 > 0 && sp.HitP50 <= sp.HitP99 && sp.RecomputeP50 <= sp.RecomputeP99) {
		t.Errorf("speed: TTFT percentiles %+v", sp)
	}
	if sp.RecomputeComputed <= sp.HitComputed {
		t.Errorf("speed: recompute computed %.0f tokens per request, host hits %.0f: the hits computed the prefix too", sp.RecomputeComputed, sp.HitComputed)
	}
	if sp.LoadBytes == 0 || !(sp.LoaderMBs > 0) || !(sp.CopyMBs > 0) {
		t.Errorf("speed: loader %d bytes at %.0f MB/s, copy %.0f MB/s", sp.LoadBytes, sp.LoaderMBs, sp.CopyMBs)
	}
	out := checkReport(t, rep.Print, "index-K race", "unlimited", "64MiB/s", "differ mean", "host hits/run", "host hit TTFT p50 / recompute p50", "plain Go copy")
	if strings.Contains(out, "FAIL") {
		t.Error("report says FAIL")
	}
}

// Under the race detector the fault-on cells are refused before anything
// runs: the fault is a data race between the loader and the forward pass.
func TestRunHiCacheFaultRefusedUnderRace(t *testing.T) {
	if !raceDetector {
		t.Skip("the race detector is off: the fault-on cells would run")
	}
	_, err := RunHiCache(t.Context(), HiCacheConfig{Home: t.TempDir(), Size: builtin.SizeTiny, Fault: true}, io.Discard)
	if !errors.Is(err, ErrRaceDetector) {
		t.Fatalf("err %v, want ErrRaceDetector", err)
	}
}

// TestNewScript checks the incident's script: whole conversations of the
// asked turns over one system prefix, each turn extending the previous one.
func TestNewScript(t *testing.T) {
	s := newScript(3, 40, 20, 6, 512)
	if len(s.convs) != 4 || len(s.convs[3]) != 2 {
		t.Fatalf("%d conversations (last of %d turns), want 4 (last of 2)", len(s.convs), len(s.convs[len(s.convs)-1]))
	}
	sys := s.convs[0][0][:40]
	for ci, c := range s.convs {
		for ti, p := range c {
			if !slices.Equal(p[:40], sys) {
				t.Errorf("conversation %d turn %d does not start with the system prefix", ci, ti)
			}
			if ti > 0 && (len(p) <= len(c[ti-1]) || !slices.Equal(p[:len(c[ti-1])], c[ti-1])) {
				t.Errorf("conversation %d turn %d does not extend the previous turn", ci, ti)
			}
		}
	}
	if again := newScript(3, 40, 20, 6, 512); !slices.Equal(again.convs[2][5], s.convs[2][5]) {
		t.Error("the same seed gave another script")
	}
}
