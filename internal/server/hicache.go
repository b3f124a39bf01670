package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/hicache"
	"github.com/pdkit/pdkit/engine/serve"
)

// hicacheSwitchWait bounds how long an admin switch of the host tier waits
// for every rank to show it (the loops take a switch at their next
// iteration) before it answers 202, the switch still pending.
const hicacheSwitchWait = 2 * time.Second

// hicacheState is every rank's host tier as the ranks last published it.
func (s *Server) hicacheState() debug.HiCacheResponse {
	snaps := s.eng.View().HiCache()
	resp := debug.HiCacheResponse{PrefixCache: !s.eng.Config().DisablePrefixCache, NoTier: s.eng.Config().NoHostTier(), On: len(snaps) > 0,
		Ranks: make([]debug.HiCacheRank, 0, len(snaps))}
	for _, ts := range snaps {
		resp.Ranks = append(resp.Ranks, debugTier(ts))
		resp.On = resp.On && ts.On
	}
	return resp
}

// debugTier is a rank's tier snapshot as the debug API writes it.
func debugTier(ts serve.TierSnapshot) debug.HiCacheRank {
	t := ts.Totals
	r := debug.HiCacheRank{
		Rank: ts.Rank, On: ts.On, Policy: ts.Policy, LoadBandwidthBytesPerSecond: ts.LoadBandwidth, PageSize: ts.PageSize,
		HostPages: ts.HostPages, HostPagesUsed: ts.HostUsed, HostOnlyPages: ts.HostOnlyPages,
		HostTokens: ts.HostPages * ts.PageSize, HostTokensUsed: ts.HostUsed * ts.PageSize,
		Totals: debug.HiCacheTotals{
			Backups: t.Backups, BackupBytes: t.BackupBytes, BackupFailures: t.BackupFailures, BackupMS: t.BackupSeconds * 1000,
			Loads: t.Loads, LoadBytes: t.LoadBytes, LoadFailures: t.LoadFailures, LoadMS: t.LoadSeconds * 1000,
			HostHits: t.HostHits, HitTokens: t.HitTokens, AbandonedLoads: t.Abandoned, DroppedTokens: t.DroppedTokens,
		},
		Loads:        make([]debug.HiCacheLoad, len(ts.Loads)),
		WaitKVMS:     secondsToMS(ts.WaitKVSeconds),
		WaitIndexKMS: secondsToMS(ts.WaitIndexKSeconds),
	}
	for i, l := range ts.Loads {
		ids := make([]debug.ID, len(l.Requests))
		for j, id := range l.Requests {
			ids[j] = debug.ID(id)
		}
		r.Loads[i] = debug.HiCacheLoad{Requests: ids, Pages: l.Pages, KVLayers: l.KVLayers, IndexLayers: l.IndexLayers, Layers: l.Layers, Over: l.Over}
	}
	return r
}

func secondsToMS(s []float64) []float64 {
	out := make([]float64, len(s))
	for i, v := range s {
		out[i] = v * 1000
	}
	return out
}

// hicache serves GET /debug/v1/hicache. Like the other debug handlers it
// reads only what the loops published, so it answers while a loop is stuck.
func (s *Server) hicache(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, s.hicacheState())
}

// errNoPrefixCache answers a host tier call on a server without a prefix
// cache.
var errNoPrefixCache = &openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest,
	Message: "hicache needs the prefix cache, which is off on this server (--no-prefix-cache)"}

// adminHiCache switches every rank's host tier on or off: 200 with the
// new state once every rank shows it, 202 (pending) when the loops have not
// taken the switch within hicacheSwitchWait; 409 when another switch is
// pending, the host memory does not suffice, or the server has no prefix
// cache.
func (s *Server) adminHiCache(on bool) http.HandlerFunc {
	dir := "off"
	if on {
		dir = "on"
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if why := s.eng.Config().NoHostTier(); why != "" {
			setResult(r, "hicache %s: %s", dir, why)
			(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest, Message: why}).WriteJSON(w)
			return
		}
		done := func(st debug.HiCacheResponse) bool {
			for _, rk := range st.Ranks {
				if rk.On != on {
					return false
				}
			}
			return true
		}
		// Queued even when every rank already is as asked: the engine
		// refuses it while another switch is pending, which the ranks'
		// state cannot show.
		changed := !done(s.hicacheState())
		err := s.eng.SetHiCache(on)
		switch {
		case errors.Is(err, serve.ErrHiCacheBusy):
			setResult(r, "hicache %s: %v", dir, err)
			(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest,
				Message: "another hicache switch is pending: retry once GET " + debug.HiCachePath + " shows it taken"}).WriteJSON(w)
			return
		case errors.Is(err, hicache.ErrHostMemory):
			setResult(r, "hicache %s: %v", dir, err)
			(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest,
				Message: err.Error() + " (the server's --hicache-size or --hicache-ratio sizes it)"}).WriteJSON(w)
			return
		case err != nil:
			setResult(r, "hicache %s: %v", dir, err)
			(&openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServer, Message: err.Error()}).WriteJSON(w)
			return
		}
		if changed {
			s.opts.Metrics.HiCacheSwitched(on)
		}
		st, ok := s.awaitTier(r.Context(), done)
		s.answerSwitch(w, r, st, ok, changed, "hicache "+dir)
	}
}

// adminHiCacheBandwidth paces every rank's loads back from host: the
// bytes_per_second of the query or of the JSON body (0: unlimited).
func (s *Server) adminHiCacheBandwidth(w http.ResponseWriter, r *http.Request) {
	if s.eng.Config().DisablePrefixCache {
		setResult(r, "hicache bandwidth: no prefix cache")
		errNoPrefixCache.WriteJSON(w)
		return
	}
	bps, oerr := bandwidthOf(r)
	if oerr != nil {
		setResult(r, "hicache bandwidth: %s", oerr.Message)
		oerr.WriteJSON(w)
		return
	}
	prev := int64(-1)
	if h := s.eng.View().Settings().HiCache; h != nil {
		prev = h.LoadBandwidthBytesPerSecond
	}
	if err := s.eng.SetHiCacheBandwidth(bps); err != nil {
		setResult(r, "hicache bandwidth: %v", err)
		openai.InvalidRequest("bytes_per_second", err.Error()).WriteJSON(w)
		return
	}
	st, ok := s.awaitTier(r.Context(), func(st debug.HiCacheResponse) bool {
		for _, rk := range st.Ranks {
			if rk.LoadBandwidthBytesPerSecond != bps {
				return false
			}
		}
		return true
	})
	s.answerSwitch(w, r, st, ok, prev != bps, fmt.Sprintf("hicache load bandwidth %d bytes/s", bps))
}

// bandwidthOf reads bytes_per_second from r's query, else from its JSON
// body.
func bandwidthOf(r *http.Request) (int64, *openai.Error) {
	bad := func(format string, args ...any) (int64, *openai.Error) {
		return 0, openai.InvalidRequest("bytes_per_second", fmt.Sprintf(format, args...))
	}
	if v := r.URL.Query().Get("bytes_per_second"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return bad("bytes_per_second %q: want a non-negative integer (0: unlimited)", v)
		}
		return n, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err != nil {
		return bad("reading the body: %v", err)
	}
	var req debug.HiCacheBandwidthRequest
	if len(body) > 0 {
		if err := json.Unmarshal(body, &req); err != nil {
			return bad("the body is not {\"bytes_per_second\": N}: %v", err)
		}
	}
	switch {
	case req.BytesPerSecond == nil:
		return bad("bytes_per_second missing: give it in the query (?bytes_per_second=N) or the body ({\"bytes_per_second\": N}); 0 is unlimited")
	case *req.BytesPerSecond < 0:
		return bad("bytes_per_second %d: want non-negative (0: unlimited)", *req.BytesPerSecond)
	}
	return *req.BytesPerSecond, nil
}

// awaitTier polls the ranks' published tiers until done holds of them, at
// most hicacheSwitchWait; it returns the last state and whether done held.
func (s *Server) awaitTier(ctx context.Context, done func(debug.HiCacheResponse) bool) (debug.HiCacheResponse, bool) {
	deadline := time.Now().Add(hicacheSwitchWait)
	for {
		st := s.hicacheState()
		if done(st) {
			return st, true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return st, false
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// answerSwitch answers a switch the engine took: 200 with the state every
// rank shows, or 202 with Pending while some rank has not shown it yet.
func (s *Server) answerSwitch(w http.ResponseWriter, r *http.Request, st debug.HiCacheResponse, shown, changed bool, what string) {
	resp := debug.HiCacheSwitchResponse{Changed: changed, Pending: !shown, HiCacheResponse: st}
	status := http.StatusOK
	if !shown {
		status = http.StatusAccepted
		setResult(r, "%s: queued, not yet taken by every rank", what)
	} else {
		setResult(r, "%s", what)
	}
	s.log.Info("hicache switch", "switch", what, "changed", changed, "taken", shown)
	writeJSON(w, status, resp)
}

// adminHiCacheOffload moves the cached prefix of the body's prompt (text
// or token ids) to every rank's host tier, so that the next request with
// it loads it back: {"offloaded_tokens": N}. 400 on a bad body; 409 when
// the tier is off (or there is no prefix cache) or another offload is
// waiting for the loops.
func (s *Server) adminHiCacheOffload(w http.ResponseWriter, r *http.Request) {
	if s.eng.Config().DisablePrefixCache {
		setResult(r, "hicache offload: no prefix cache")
		errNoPrefixCache.WriteJSON(w)
		return
	}
	prompt, oerr := s.offloadPrompt(w, r)
	if oerr != nil {
		setResult(r, "hicache offload: %s", oerr.Message)
		oerr.WriteJSON(w)
		return
	}
	if !s.hicacheState().On {
		setResult(r, "hicache offload: the tier is off")
		(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest,
			Message: "hicache is off on this server: switch it on first (POST " + debug.HiCacheOnPath + ")"}).WriteJSON(w)
		return
	}
	n, err := s.eng.Offload(r.Context(), prompt)
	switch {
	case errors.Is(err, serve.ErrOffloadBusy):
		setResult(r, "hicache offload: %v", err)
		(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest,
			Message: "another offload is waiting for the loops: retry"}).WriteJSON(w)
		return
	case err != nil && !s.hicacheState().On:
		setResult(r, "hicache offload: %v", err)
		(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest, Message: err.Error()}).WriteJSON(w)
		return
	case err != nil:
		setResult(r, "hicache offload: %v", err)
		openai.ServerError(err.Error()).WriteJSON(w)
		return
	}
	setResult(r, "hicache offload: %d of %d tokens", n, len(prompt))
	writeJSON(w, http.StatusOK, debug.HiCacheOffloadResponse{PromptTokens: len(prompt), OffloadedTokens: n})
}

// offloadPrompt reads an offload's body: exactly one of a text prompt,
// encoded as a completion's, or token ids of the model's vocabulary.
func (s *Server) offloadPrompt(w http.ResponseWriter, r *http.Request) ([]int32, *openai.Error) {
	bad := func(param, format string, args ...any) ([]int32, *openai.Error) {
		return nil, openai.InvalidRequest(param, fmt.Sprintf(format, args...))
	}
	var req debug.HiCacheOffloadRequest
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxBodyBytes))
	if err != nil {
		return bad("", "reading the body: %v", err)
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return bad("", `the body is not {"prompt": "text"} or {"tokens": [ids]}: %v`, err)
	}
	switch {
	case req.Prompt != "" && req.Tokens != nil:
		return bad("prompt", "give the prompt as text or as tokens, not both")
	case req.Tokens != nil:
		if len(req.Tokens) == 0 {
			return bad("tokens", "tokens must not be empty")
		}
		for i, t := range req.Tokens {
			if t < 0 || int(t) >= s.m.Config.VocabSize {
				return bad("tokens", "tokens[%d] = %d is not a token id of the model (0 to %d)", i, t, s.m.Config.VocabSize-1)
			}
		}
		return req.Tokens, nil
	case req.Prompt == "":
		return bad("prompt", `a prompt is required: {"prompt": "text"} or {"tokens": [ids]}`)
	}
	p, err := s.tok.Encode(req.Prompt, true)
	if err != nil {
		return bad("prompt", "%v", err)
	}
	return p, nil
}
