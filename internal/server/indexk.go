package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
)

// indexKSwitchTo is the precision of the index-K switch this server's
// admin API started and the engine has not finished; empty when none.
func (s *Server) indexKSwitchTo() string {
	s.indexKMu.Lock()
	defer s.indexKMu.Unlock()
	return s.indexKTo
}

// indexKOutcome is what the engine's SetIndexK returned.
type indexKOutcome struct {
	res serve.IndexKSwitch
	err error
}

// adminIndexK switches the index-K precision to dt live
// (serve.Engine.SetIndexK): the engine drains, aborting what is still in
// flight after ?drain= (default debug.IndexKDefaultDrain), and switches
// every rank. The call waits for the switch: 200 with its outcome, or 202
// (pending) when it is not done within the drain bound and the margin
// (Options.IndexKMargin); the switch goes on either way, and so it does when
// the caller goes. 409 while a switch is under way, 400 for a model without
// a sparse indexer or a bad drain.
func (s *Server) adminIndexK(dt kernels.IndexKDType) http.HandlerFunc {
	to := dt.String()
	return func(w http.ResponseWriter, r *http.Request) {
		if !s.eng.View().Settings().Indexer {
			setResult(r, "index-K %s: no indexer", to)
			openai.InvalidRequest("", "the model has no sparse indexer: it stores no index keys, so it has no index-K precision to switch").WriteJSON(w)
			return
		}
		drain := debug.IndexKDefaultDrain
		if v := r.URL.Query().Get("drain"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				setResult(r, "index-K %s: bad drain %q", to, v)
				openai.InvalidRequest("drain", fmt.Sprintf("drain %q: want a non-negative duration such as 30s or 2m", v)).WriteJSON(w)
				return
			}
			drain = d
		}
		// busy answers 409 for a switch under way to where ("": not
		// known, one this server's admin API did not start).
		busy := func(where string) {
			msg := fmt.Sprintf("an index-K switch is under way: retry once it is done (GET %s)", debug.SettingsPath)
			if where != "" {
				msg = fmt.Sprintf("an index-K switch to %s is under way: retry once GET %s shows index_k %s", where, debug.SettingsPath, where)
			}
			setResult(r, "index-K %s: %s", to, msg)
			(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest, Message: msg}).WriteJSON(w)
		}
		s.indexKMu.Lock()
		if s.indexKTo != "" {
			where := s.indexKTo
			s.indexKMu.Unlock()
			busy(where)
			return
		}
		s.indexKTo = to
		s.indexKMu.Unlock()

		start := time.Now()
		done := make(chan indexKOutcome, 1)
		gone := make(chan struct{}) // closed once the call is answered without the outcome
		go func() {
			// Not the call's context: a switch, once asked for, goes on.
			res, err := s.eng.SetIndexK(context.Background(), dt, drain)
			s.indexKMu.Lock()
			s.indexKTo = ""
			s.indexKMu.Unlock()
			done <- indexKOutcome{res: res, err: err}
			select {
			case <-gone:
				if err != nil {
					s.log.Warn("index-K switch failed after its call was answered", "to", to, "err", err)
				} else {
					s.log.Info("index-K switch done after its call was answered", "from", res.From.String(), "to", to,
						"paused", res.Paused, "aborted", res.Aborted)
				}
			default:
			}
		}()
		timer := time.NewTimer(drain + s.opts.IndexKMargin)
		defer timer.Stop()
		var out indexKOutcome
		select {
		case out = <-done:
		case <-timer.C:
			close(gone)
			setResult(r, "index-K %s: still under way after %v", to, time.Since(start).Round(time.Millisecond))
			writeJSON(w, http.StatusAccepted, debug.IndexKSwitchResponse{From: s.eng.View().IndexK().String(), To: to, Changed: true,
				PausedMS: ms(time.Since(start)), Pending: true})
			return
		case <-r.Context().Done():
			close(gone)
			setResult(r, "index-K %s: the caller went; the switch goes on", to)
			return
		}
		switch err := out.err; {
		case errors.Is(err, serve.ErrIndexKBusy):
			busy("")
			return
		case err != nil:
			setResult(r, "index-K %s: %v", to, err)
			(&openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServer, Message: err.Error()}).WriteJSON(w)
			return
		}
		res := out.res
		if res.Changed {
			setResult(r, "index-K %s → %s: paused %v, %d aborted", res.From, res.To, res.Paused.Round(time.Millisecond), res.Aborted)
		} else {
			setResult(r, "index-K %s: already", to)
		}
		writeJSON(w, http.StatusOK, debug.IndexKSwitchResponse{From: res.From.String(), To: res.To.String(), Changed: res.Changed,
			PausedMS: ms(res.Paused), Aborted: res.Aborted})
	}
}

// adminIndexKUnknown answers a switch to a precision there is none of.
func (s *Server) adminIndexKUnknown(w http.ResponseWriter, r *http.Request) {
	dt := r.PathValue("dtype")
	setResult(r, "index-K %q: unknown precision", dt)
	openai.InvalidRequest("dtype", fmt.Sprintf("unknown index-K precision %q: want %s or %s", dt, debug.IndexKFP8, debug.IndexKBF16)).WriteJSON(w)
}
