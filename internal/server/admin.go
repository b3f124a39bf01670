package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/httpx"
	"github.com/pdkit/pdkit/kernels"
)

// adminResult carries, through a call's context, what an admin handler did,
// for the log line of the call.
type adminResult struct{}

func setResult(r *http.Request, format string, args ...any) {
	if p, ok := r.Context().Value(adminResult{}).(*string); ok {
		*p = fmt.Sprintf(format, args...)
	}
}

// adminHandler serves /admin/v1/: every call is checked first (see
// adminRule), whatever its path, then dispatched and logged with the
// caller's address, the call and its result.
func (s *Server) adminHandler() http.Handler {
	mux := http.NewServeMux()
	post := func(path string, h http.HandlerFunc) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost {
				w.Header().Set("Allow", http.MethodPost)
				(&openai.Error{Status: http.StatusMethodNotAllowed, Type: openai.TypeInvalidRequest,
					Message: fmt.Sprintf("method %s not allowed on %s; use POST", r.Method, r.URL.Path)}).WriteJSON(w)
				return
			}
			h(w, r)
		})
	}
	post("/admin/v1/requests/{id}/abort", s.adminAbort)
	post("/admin/v1/abort_all", s.adminAbortAll)
	post("/admin/v1/rooms/{room}/abort", s.adminAbortRoom)
	post("/admin/v1/faults/{name}/on", s.adminFault(true))
	post("/admin/v1/faults/{name}/off", s.adminFault(false))
	post(debug.HiCacheOnPath, s.adminHiCache(true))
	post(debug.HiCacheOffPath, s.adminHiCache(false))
	post(debug.HiCacheBandwidthPath, s.adminHiCacheBandwidth)
	post(debug.HiCacheOffloadPath, s.adminHiCacheOffload)
	post(debug.ModelVerifyPath, s.adminModelVerify)
	post(debug.IndexKPath(debug.IndexKFP8), s.adminIndexK(kernels.IndexFP8))
	post(debug.IndexKPath(debug.IndexKBF16), s.adminIndexK(kernels.IndexBF16))
	post(debug.IndexKPath("{dtype}"), s.adminIndexKUnknown)
	mux.HandleFunc("/", s.mux.NotFound)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rw := &httpx.Recorder{ResponseWriter: w}
		var result string
		defer func() {
			s.log.Info("admin call", "remote", r.RemoteAddr, "method", r.Method, "path", r.URL.Path,
				"status", rw.Status, "result", result)
		}()
		if oerr := s.adminRule().Check(rw, r); oerr != nil {
			result = oerr.Message
			oerr.WriteJSON(rw)
			return
		}
		mux.ServeHTTP(rw, r.WithContext(context.WithValue(r.Context(), adminResult{}, &result)))
	})
}

// adminRule is the admin rule: with Options.AdminToken set, the call must
// carry "Authorization: Bearer <token>"; without one, a server with a
// cluster secret takes the token the secret derives
// (clusterauth.Secret.AdminToken), and only a server without either, bound
// to loopback (Options.Loopback), takes admin calls without a token: on a
// cluster with a secret, a stranger on the host cannot switch faults or
// abort requests any more than a stranger elsewhere.
func (s *Server) adminRule() httpx.AdminRule {
	if s.opts.AdminToken != "" {
		return httpx.AdminRule{Token: s.opts.AdminToken}
	}
	tok := s.opts.ClusterSecret.AdminToken()
	return httpx.AdminRule{Token: tok, Derived: tok != "", Loopback: s.opts.Loopback}
}

// knownWait bounds how long an abort by id waits for a pending request to
// show up in the engine's snapshot.
const knownWait = 250 * time.Millisecond

func (s *Server) adminAbort(w http.ResponseWriter, r *http.Request) {
	raw := r.PathValue("id")
	id, ok := parseID(raw)
	if !ok {
		setResult(r, "bad id %q", raw)
		openai.InvalidRequest("id", fmt.Sprintf("%q is not a request id (cmpl-N, chatcmpl-N or N)", raw)).WriteJSON(w)
		return
	}
	if !s.ownID(raw) {
		setResult(r, "request %q is another server's", raw)
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Param: "id",
			Message: fmt.Sprintf("%q is another server's request", raw)}).WriteJSON(w)
		return
	}
	if !s.known(id) {
		setResult(r, "request %d not found", id)
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Param: "id",
			Message: fmt.Sprintf("request %d is not known to the engine (finished, or never submitted)", id)}).WriteJSON(w)
		return
	}
	s.eng.Abort(id)
	setResult(r, "aborted %d", id)
	writeJSON(w, http.StatusOK, debug.AbortResponse{Aborted: debug.ID(id)})
}

// known reports whether id is in a queue of the engine's latest snapshot.
// A request submitted but not yet taken by the loop is in no snapshot yet:
// known waits (at most knownWait) until no request is pending and a
// snapshot published after that moment lacks id. Best effort: a loop stuck
// that long makes a pending id unknown.
func (s *Server) known(id uint64) bool {
	deadline := time.Now().Add(knownWait)
	var drained time.Time // when no request was pending any more
	for {
		snap := s.eng.View().Snapshot()
		for _, name := range debug.Queues {
			for _, ri := range queueOf(snap.Queue, name) {
				if ri.ID == id {
					return true
				}
			}
		}
		if pd := s.eng.PD().QueueEntries(); len(pd) > 0 {
			for _, en := range pd[0] {
				if en.ID == id {
					return true
				}
			}
		}
		now := time.Now()
		switch {
		case !drained.IsZero() && snap.Taken.After(drained):
			return false
		case drained.IsZero() && s.eng.View().Health(now).Pending == 0:
			drained = now
		}
		if now.After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

func (s *Server) adminAbortAll(w http.ResponseWriter, r *http.Request) {
	q := s.eng.View().Snapshot().Queue
	ids := []uint64{}
	for _, name := range []string{debug.QueueWaiting, debug.QueuePrefilling, debug.QueueRunning} {
		for _, ri := range queueOf(q, name) {
			s.eng.Abort(ri.ID)
			ids = append(ids, ri.ID)
		}
	}
	if pd := s.eng.PD().QueueEntries(); len(pd) > 0 {
		for _, en := range pd[0] {
			if !slices.Contains(ids, en.ID) {
				s.eng.Abort(en.ID)
				ids = append(ids, en.ID)
			}
		}
	}
	setResult(r, "aborted %d requests %v", len(ids), ids)
	out := make([]debug.ID, len(ids))
	for i, id := range ids {
		out[i] = debug.ID(id)
	}
	writeJSON(w, http.StatusOK, debug.AbortAllResponse{Aborted: out})
}

// adminFault switches a fault on or off: 200 with every fault's state, 400
// for a fault unknown or of another role.
func (s *Server) adminFault(on bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		if err := s.eng.SetFault(name, on); err != nil {
			setResult(r, "fault %s: %v", name, err)
			openai.InvalidRequest("name", err.Error()).WriteJSON(w)
			return
		}
		setResult(r, "fault %s on=%t", name, on)
		writeJSON(w, http.StatusOK, faultList(s.eng))
	}
}

// faults lists the fault switches (GET /debug/v1/faults).
func (s *Server) faults(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, faultList(s.eng))
}

func faultList(e *serve.Engine) debug.FaultsResponse {
	var out debug.FaultsResponse
	for _, f := range e.View().Faults() {
		out.Faults = append(out.Faults, debug.Fault{Name: f.Name, Roles: f.Roles, Doc: f.Doc, On: f.On})
	}
	return out
}

// adminAbortRoom aborts the live PD request of a bootstrap room (the
// router's key for the pair of requests on a prefill and a decode server).
func (s *Server) adminAbortRoom(w http.ResponseWriter, r *http.Request) {
	raw := r.PathValue("room")
	room, err := strconv.ParseUint(raw, 10, 64)
	if err != nil {
		setResult(r, "bad room %q", raw)
		openai.InvalidRequest("room", fmt.Sprintf("%q is not a bootstrap room (an unsigned 64-bit integer)", raw)).WriteJSON(w)
		return
	}
	id, ok := s.eng.PD().RoomRequest(room)
	if !ok {
		setResult(r, "room %d not found", room)
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Param: "room",
			Message: fmt.Sprintf("no live request of room %d", room)}).WriteJSON(w)
		return
	}
	s.eng.Abort(id)
	setResult(r, "aborted room %d (request %d)", room, id)
	writeJSON(w, http.StatusOK, debug.AbortResponse{Aborted: debug.ID(id)})
}

// adminModelVerify serves POST /admin/v1/model/verify: the whole model
// file rehashed now against its baseline full hash. It reads the whole
// file, hence an admin call, one at a time (409 while one runs); a file
// found changed stays changed in GET /debug/v1/settings' model_file.
func (s *Server) adminModelVerify(w http.ResponseWriter, r *http.Request) {
	if s.m == nil {
		setResult(r, "model verify: no model")
		(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest, Message: "this server has no model to verify"}).WriteJSON(w)
		return
	}
	c, err := s.m.VerifyFile(r.Context(), time.Now)
	switch {
	case errors.Is(err, model.ErrVerifying):
		setResult(r, "model verify: %v", err)
		(&openai.Error{Status: http.StatusConflict, Type: openai.TypeInvalidRequest, Message: err.Error() + ": retry when it ends"}).WriteJSON(w)
		return
	case err != nil:
		setResult(r, "model verify: %v", err)
		(&openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServer, Message: err.Error()}).WriteJSON(w)
		return
	}
	setResult(r, "model verify: %s (matches %v)", c.SHA256, c.Matches())
	writeJSON(w, http.StatusOK, debug.ModelVerifyResponse{Path: c.Path, SHA256: c.SHA256, Baseline: c.Baseline, First: c.First,
		Matches: c.Matches(), TookMS: ms(c.Took)})
}
