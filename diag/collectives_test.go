package diag

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// twoRanks is a reachable TP-2 server at step 5000 on both ranks, control
// seq 15000 and forward seq 20000, in no collective.
func twoRanks() ServerSample {
	s := ServerSample{Server: Server{URL: "http://x", Role: "decode", TPSize: 2}, Reachable: true,
		Steps: &debug.StepsResponse{Agree: true}, Collectives: &debug.CollectivesResponse{StallThresholdMS: 5000}}
	for _, name := range debug.Comms {
		s.Collectives.Comms = append(s.Collectives.Comms, debug.Communicator{Name: name, Size: 2})
	}
	for r := range 2 {
		s.Steps.Ranks = append(s.Steps.Ranks, debug.Step{Rank: r, Step: 5000, Phase: "decode", Digest: "9f1c0a6be3d2f4a1", ControlSeq: 15000, ForwardSeq: 20000})
		for i := range s.Collectives.Comms {
			seq := s.Steps.Ranks[r].Seq(s.Collectives.Comms[i].Name)
			s.Collectives.Comms[i].Ranks = append(s.Collectives.Comms[i].Ranks, debug.CollectiveRank{Rank: r, LastEntered: seq, LastCompleted: seq})
		}
	}
	return s
}

// waitIn puts rank in a call of comm, seq, op, waiting for d.
func waitIn(s *ServerSample, comm string, rank int, seq uint64, op string, d time.Duration) {
	cr := s.Collectives.Comm(comm).Rank(rank)
	cr.LastEntered = seq
	cr.Waiting = &debug.Collective{Seq: seq, Op: op, Elem: "int64", Waiting: true, DurationMS: float64(d) / float64(time.Millisecond)}
}

func divergence(s ServerSample) []Finding {
	now := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	fs := checkRankDivergence(DefaultConfig(), Window{Samples: []Sample{{Taken: now, Servers: []ServerSample{s}}}})
	Sort(fs)
	return fs
}

// TestDivergenceAcrossCommunicators: seqs count per communicator, so a
// rank waiting in control seq N and a peer waiting in forward seq N are in
// different calls; the finding names each call with its communicator.
func TestDivergenceAcrossCommunicators(t *testing.T) {
	s := twoRanks()
	waitIn(&s, debug.CommControl, 0, 15001, "AllReduceMin", 6*time.Second)
	waitIn(&s, debug.CommForward, 1, 15001, "AllReduceSum", 5*time.Second)
	fs := divergence(s)
	if len(fs) != 2 {
		t.Fatalf("want a finding per waiting rank, got:\n%s", render(fs))
	}
	if got, want := fs[0].Summary, "rank 0 waits in control seq 15001 AllReduceMin for 6s while rank 1 waits in forward seq 15001 AllReduceSum"; got != want {
		t.Errorf("summary %q, want %q", got, want)
	}
	if got, want := fs[0].Evidence[1], ev("rank 1", "lockstep loop, step 5000 (decode), waits in forward seq 15001 AllReduceSum for 5s"); got != want {
		t.Errorf("peer evidence %+v, want %+v", got, want)
	}
	if got := fs[1].Summary; !strings.HasPrefix(got, "rank 1 waits in forward seq 15001 AllReduceSum for 5s while rank 0 waits in control seq 15001") {
		t.Errorf("rank 1's summary %q", got)
	}
}

// TestDivergenceSameCall: ranks waiting in the same call of one
// communicator have both arrived: no finding, however long the wait (the
// stall is someone else's, or the group's).
func TestDivergenceSameCall(t *testing.T) {
	for _, comm := range debug.Comms {
		s := twoRanks()
		waitIn(&s, comm, 0, 30001, "AllReduceSum", 9*time.Second)
		waitIn(&s, comm, 1, 30001, "AllReduceSum", 9*time.Second)
		if fs := divergence(s); len(fs) != 0 {
			t.Errorf("%s: both ranks in the same call:\n%s", comm, render(fs))
		}
	}
}

// TestDivergencePeerElsewhereOnBoth: a peer that waits on both
// communicators at once (the overlap loop's shape) is named in both; one
// that waits in no call is named with its last seq on each communicator;
// a broken communicator is evidence.
func TestDivergencePeerElsewhereOnBoth(t *testing.T) {
	s := twoRanks()
	s.Steps.Ranks = append(s.Steps.Ranks, debug.Step{Rank: 2, Step: 5000, ControlSeq: 15000, ForwardSeq: 20000})
	for i := range s.Collectives.Comms {
		c := &s.Collectives.Comms[i]
		c.Size = 3
		seq := s.Steps.Ranks[2].Seq(c.Name)
		c.Ranks = append(c.Ranks, debug.CollectiveRank{Rank: 2, LastEntered: seq, LastCompleted: seq})
	}
	fwd := s.Collectives.Comm(debug.CommForward)
	fwd.Broken, fwd.BrokenReason = true, "rank 2 failed"
	waitIn(&s, debug.CommForward, 0, 20001, "AllReduceSum", 3*time.Second)
	waitIn(&s, debug.CommControl, 1, 15001, "Broadcast", time.Second)
	waitIn(&s, debug.CommForward, 1, 20002, "AllGather", time.Second)
	fs := divergence(s)
	if len(fs) != 1 {
		t.Fatalf("want rank 0's finding only (rank 1 waits below the threshold), got:\n%s", render(fs))
	}
	want := []Evidence{
		ev("rank 0", "lockstep loop, step 5000 (decode), waits in forward seq 20001 AllReduceSum for 3s (threshold 2s)"),
		ev("rank 1", "lockstep loop, step 5000 (decode), waits in control seq 15001 Broadcast for 1s and waits in forward seq 20002 AllGather for 1s"),
		ev("rank 2", "lockstep loop, step 5000, not in a collective (control: last entered seq 15000, last completed 15000; forward: last entered seq 20000, last completed 20000)"),
		ev("forward communicator", "broken: rank 2 failed"),
	}
	if got := fs[0].Evidence; len(got) != len(want) {
		t.Fatalf("evidence %+v, want %+v", got, want)
	}
	for i := range want {
		if fs[0].Evidence[i] != want[i] {
			t.Errorf("evidence %d: %+v, want %+v", i, fs[0].Evidence[i], want[i])
		}
	}
	if got, want := fs[0].Summary, "rank 0 waits in forward seq 20001 AllReduceSum for 3s while rank 1 waits in control seq 15001 Broadcast and forward seq 20002 AllGather; rank 2 is not in a collective (last forward seq 20000)"; got != want {
		t.Errorf("summary %q, want %q", got, want)
	}
}

// TestSeqDivergencePerCommunicator: ranks that finished the same step out
// of any collective must agree on both seqs; the finding names the
// communicators that differ. A rank in a call on either communicator, or
// no collectives answer, leaves the seqs unjudged.
func TestSeqDivergencePerCommunicator(t *testing.T) {
	for _, tc := range []struct {
		name        string
		ctrl, fwd   uint64 // rank 1's seqs
		wantSummary string
	}{
		{"agree", 15000, 20000, ""},
		{"control", 14998, 20000, "ranks 0 and 1 both finished step 5000 but at control seq 15000 and 14998"},
		{"forward", 15000, 20004, "ranks 0 and 1 both finished step 5000 but at forward seq 20000 and 20004"},
		{"both", 15001, 19996, "ranks 0 and 1 both finished step 5000 but at control seq 15000 and 15001, forward seq 20000 and 19996"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := twoRanks()
			s.Steps.Ranks[1].ControlSeq, s.Steps.Ranks[1].ForwardSeq = tc.ctrl, tc.fwd
			fs := divergence(s)
			switch {
			case tc.wantSummary == "" && len(fs) != 0:
				t.Errorf("findings:\n%s", render(fs))
			case tc.wantSummary != "" && (len(fs) != 1 || fs[0].Summary != tc.wantSummary):
				t.Errorf("findings:\n%s\nwant summary %q", render(fs), tc.wantSummary)
			}
			if tc.wantSummary == "" {
				return
			}
			// Rank 1 inside a forward call (below the wait threshold):
			// its seqs may be mid-step, no judgement.
			waitIn(&s, debug.CommForward, 1, 20005, "AllReduceSum", 10*time.Millisecond)
			if fs := divergence(s); len(fs) != 0 {
				t.Errorf("with rank 1 in a forward call:\n%s", render(fs))
			}
			s.Collectives.Comm(debug.CommForward).Rank(1).Waiting = nil
			s.Collectives = nil
			if fs := divergence(s); len(fs) != 0 {
				t.Errorf("without a collectives answer:\n%s", render(fs))
			}
		})
	}
}

// TestDivergenceRemedyFollowsTheFaults: with stall-last-rank on, the
// finding names the switch as evidence and the remedy switches it off on
// that server (the ranks meet again, no restart); with another switch on,
// the remedy switches that one off before the restart; with none, it
// keeps the evidence and restarts.
func TestDivergenceRemedyFollowsTheFaults(t *testing.T) {
	for _, tc := range []struct {
		on       []string
		evidence string
		remedy   string
	}{
		{nil, "", "capture a bundle (pdctl bundle -o FILE.tar.gz) with the flight recorders and stacks, then restart the server"},
		{[]string{"stall-last-rank"}, "stall-last-rank on: the doc of stall-last-rank",
			"switch it off (pdctl fault off stall-last-rank --server http://x) and the ranks meet again"},
		{[]string{"delay-heartbeat"}, "delay-heartbeat on: the doc of delay-heartbeat",
			"switch off the fault switches on (pdctl fault off delay-heartbeat --server http://x), then restart the server"},
	} {
		s := twoRanks()
		s.Faults = &debug.FaultsResponse{}
		for _, n := range []string{"stall-last-rank", "delay-heartbeat"} {
			s.Faults.Faults = append(s.Faults.Faults, debug.Fault{Name: n, Doc: "the doc of " + n, On: slices.Contains(tc.on, n)})
		}
		waitIn(&s, debug.CommControl, 0, 15001, "Broadcast", 6*time.Second)
		fs := divergence(s)
		if len(fs) != 1 {
			t.Fatalf("%v: findings:\n%s", tc.on, render(fs))
		}
		var got []string
		for _, e := range fs[0].Evidence {
			if e.Key == "fault switch" {
				got = append(got, e.Value)
			}
		}
		if want := []string{tc.evidence}; tc.evidence == "" && len(got) != 0 || tc.evidence != "" && !slices.Equal(got, want) {
			t.Errorf("%v: fault evidence %q, want %q", tc.on, got, tc.evidence)
		}
		if !strings.Contains(fs[0].Remedy, tc.remedy) {
			t.Errorf("%v: remedy %q, want it to contain %q", tc.on, fs[0].Remedy, tc.remedy)
		}
	}
}

// TestDivergenceNamesPhases: where the server tags its calls with the rank
// loop's phase, the finding names each rank's phase: the incident's shape,
// one rank in the PD poll while its peer, having gone idle on its own view,
// waits in the next step input.
func TestDivergenceNamesPhases(t *testing.T) {
	s := twoRanks()
	waitIn(&s, debug.CommControl, 0, 15001, "AllReduceMin", 6*time.Second)
	waitIn(&s, debug.CommControl, 1, 15002, "Broadcast", 6*time.Second)
	s.Collectives.Comm(debug.CommControl).Rank(0).Waiting.Phase = "poll"
	s.Collectives.Comm(debug.CommControl).Rank(1).Waiting.Phase = "input"
	fs := divergence(s)
	if len(fs) == 0 {
		t.Fatal("no finding")
	}
	if got, want := fs[0].Summary, "rank 0 waits in control seq 15001 AllReduceMin (poll) for 6s while rank 1 waits in control seq 15002 Broadcast (input)"; got != want {
		t.Errorf("summary %q, want %q", got, want)
	}
}
