package server

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
)

// decisions serves GET /debug/v1/decisions[?since=STEP]: every rank's
// decision log (engine/serve/decisions.go), newest record last, with the
// first step where the ranks' records part. Like the other debug handlers
// it answers while a loop is stuck.
func (s *Server) decisions(w http.ResponseWriter, r *http.Request) {
	var since uint64
	if v := r.URL.Query().Get("since"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			openai.InvalidRequest("since", fmt.Sprintf("since %q is not a step (an unsigned integer)", v)).WriteJSON(w)
			return
		}
		since = n
	}
	now := time.Now()
	logs := s.eng.View().Decisions(since)
	resp := debug.DecisionsResponse{LogLen: s.eng.Config().DecisionLogLen, Since: since, Ranks: make([]debug.RankDecisions, len(logs))}
	for i, l := range logs {
		rd := debug.RankDecisions{Rank: l.Rank, LastStep: l.LastStep, Records: make([]debug.DecisionRecord, len(l.Records))}
		for j, rec := range l.Records {
			rd.Records[j] = debugDecision(rec)
		}
		if l.Open != nil {
			o := debugDecision(*l.Open)
			o.Open = true
			rd.Open = &o
		}
		if wt := l.Waiting; wt != nil {
			rd.Waiting = &debug.DecisionWait{Comm: wt.Comm, Seq: wt.Seq, Op: wt.Op.String(), Since: wt.Since, WaitedMS: ms(now.Sub(wt.Since))}
		}
		resp.Ranks[i] = rd
	}
	resp.Divergence = debug.FirstDivergence(resp.Ranks)
	writeJSON(w, http.StatusOK, resp)
}

func hex16(v uint64) string { return fmt.Sprintf("%016x", v) }

func debugDecision(r serve.DecisionRecord) debug.DecisionRecord {
	in := r.Input
	d := debug.DecisionRecord{
		Step: r.Step, Phase: r.Phase, BatchSize: r.BatchSize, BatchTokens: r.BatchTokens,
		ControlSeq: r.ControlSeq, ForwardFirst: r.ForwardFirst, ForwardSeq: r.ForwardSeq,
		Input: debug.DecisionInput{NowMS: ms(in.Now), Adds: in.Adds, Aborts: in.Aborts, IDs: hex16(in.IDs),
			HiCache: in.HiCache, IndexK: in.IndexK, OffloadTokens: in.OffloadTokens, Digest: hex16(in.Digest)},
		Agreed: make([]debug.Agreement, len(r.Agreed)),
	}
	if len(r.Agreed) == 0 {
		d.Input = debug.DecisionInput{} // not received yet
	}
	if r.Plan != 0 {
		d.Plan = hex16(r.Plan)
	}
	if !r.End.IsZero() {
		end := r.End
		d.End = &end
	}
	for i, a := range r.Agreed {
		d.Agreed[i] = debug.Agreement{Name: a.Name, Op: a.Op.String(), Seq: a.Seq, Len: a.Len, Digest: hex16(a.Digest), Values: a.Values}
	}
	return d
}
