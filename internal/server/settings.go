package server

import (
	"net/http"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/sched"
)

// Settings are the server's effective settings: the engine's (its config
// after the defaults, the fault switches on now) and the HTTP server's own
// /health thresholds. GET /debug/v1/settings answers them, and GET
// /debug/v1/state carries them.
func (s *Server) Settings() debug.Settings {
	st := s.eng.View().Settings()
	st.StallAfterMS = ms(s.opts.StallAfter)
	st.MaxQueueAgeMS = ms(s.opts.MaxQueueAge)
	st.IndexKSwitch = s.indexKSwitchTo()
	st.Canaries = s.canaries.Status()
	return st
}

// settings serves GET /debug/v1/settings. Like the other debug handlers it
// reads only immutable config and atomics, so it answers while a loop is
// stuck.
func (s *Server) settings(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.Settings())
}

// state serves GET /debug/v1/state: the model, the settings, rank 0's last
// step and the engine's last published snapshot, as api/debug types.
func (s *Server) state(w http.ResponseWriter, _ *http.Request) {
	resp := debug.StateResponse{Model: s.opts.ModelName, ContextTokens: s.m.Config.ContextLen, ChatTemplate: s.tmpl.Name(), Settings: s.Settings(),
		LastStep: debugStep(s.eng.View().LastStep())}
	if snap := s.eng.View().Snapshot(); snap != nil {
		q := snap.Queue
		ds := &debug.EngineSnapshot{Taken: snap.Taken, Step: debugStep(snap.Step), Counts: queueCounts(q),
			StepInFlight: q.StepInFlight, HeldPages: q.HeldPages, TotalPages: q.TotalPages,
			Requests: s.requestInfos(q, time.Since(snap.Taken)), Error: snap.Err}
		t := snap.Totals
		ds.Totals = debug.Totals{Steps: t.Steps, Tokens: t.Tokens, Sampled: t.Sampled, Retractions: t.Retractions,
			Aborts: t.Aborts, AbortsInStep: t.AbortsInStep, Finished: t.Finished, PromptTokens: t.PromptTokens,
			CachedTokens: t.CachedTokens, PrefixHits: t.PrefixHits, PrefixEvictions: t.PrefixEvictions, Unstalls: t.Unstalls,
			IndexKSwitches: t.IndexKSwitches}
		resp.Snapshot = ds
	}
	writeJSON(w, http.StatusOK, resp)
}

// queueCounts is every scheduler queue's length.
func queueCounts(q sched.Snapshot) map[string]int {
	return map[string]int{
		debug.QueueWaiting: len(q.Waiting), debug.QueuePrefilling: len(q.Prefilling),
		debug.QueueRunning: len(q.Running), debug.QueueAborting: len(q.Aborting),
	}
}

// requestInfos lists the requests of every queue, their ages as of the
// snapshot plus since.
func (s *Server) requestInfos(q sched.Snapshot, since time.Duration) []debug.RequestInfo {
	out := []debug.RequestInfo{}
	for _, name := range debug.Queues {
		for _, ri := range queueOf(q, name) {
			out = append(out, debug.RequestInfo{
				ID: debug.ID(ri.ID), ClientRequestID: s.tagOf(ri.ID), Queue: name, AgeMS: ms(ri.Age + since), InStateMS: ms(ri.InState + since),
				PromptTokens: ri.PromptLen, MaxTokens: ri.MaxTokens, Generated: ri.Generated, Fed: ri.Fed,
				InFlight: ri.InFlight, Cached: ri.Cached, Pages: ri.Pages, Retractions: ri.Retractions,
			})
		}
	}
	return out
}
