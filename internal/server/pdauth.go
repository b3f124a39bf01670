package server

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/openai"
)

// PD requests (those with a bootstrap_room) come from the cluster's router,
// which signs them with the cluster secret (clusterauth.SignRequest over
// the method, path, time, a nonce, this server's id and the exact body).
// With Options.ClusterSecret set, a server refuses with 401 a PD request
// unsigned, wrongly signed, signed for another server (or an earlier run
// of this one) or received before (a sniffed request replayed)
// before anything of it reaches the engine, and counts it
// (pdkit_pd_refused_reqs_total{reason="unsigned"}): a stranger's unpaired
// PD request would hold a decode slot and KV pages (or a prefill's
// bootstrap entry) until the transfer timeout, and its failure would count
// against the server's readiness. Requests without PD fields are served as
// before.

// rawBodyKey is the context key of a generation request's body bytes, kept
// by keepBody for the signature check.
type rawBodyKey struct{}

// keepBody reads a generation request's body (at most its bound+1
// bytes: past that the handler answers 413 as before) and hands the
// handler a copy of it, keeping the bytes for verifyPD. Without a cluster
// secret it is h.
func (s *Server) keepBody(h http.HandlerFunc) http.HandlerFunc {
	if !s.opts.ClusterSecret.Set() {
		return h
	}
	return func(w http.ResponseWriter, r *http.Request) {
		raw, err := io.ReadAll(io.LimitReader(r.Body, s.limits.MaxBodyBytes+1))
		var body io.Reader = bytes.NewReader(raw)
		if err != nil {
			body = io.MultiReader(body, errReader{err}) // the handler reports it as it would have
		}
		r.Body = replayBody{body, r.Body}
		h(w, r.WithContext(context.WithValue(r.Context(), rawBodyKey{}, raw)))
	}
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

type replayBody struct {
	io.Reader
	orig io.ReadCloser
}

func (b replayBody) Close() error { return b.orig.Close() }

// verifyPD checks that a PD request is signed with the cluster secret; on
// failure it answers 401, counts the refusal and returns false. Without a
// secret every request passes.
func (s *Server) verifyPD(w http.ResponseWriter, r *http.Request) bool {
	secret := s.opts.ClusterSecret
	if !secret.Set() {
		return true
	}
	raw, _ := r.Context().Value(rawBodyKey{}).([]byte)
	err := s.verifier.Verify(r, raw, time.Now())
	if err == nil {
		return true
	}
	s.opts.Metrics.PDRefusedUnsigned()
	s.log.Debug("PD request refused: not signed with the cluster secret", "path", r.URL.Path, "remote", r.RemoteAddr, "err", err)
	unsignedPD(err).WriteJSON(w)
	return false
}

// unsignedPD is the answer to a PD request that verifyPD refused.
func unsignedPD(err error) *openai.Error {
	why := "it is not signed"
	switch {
	case errors.Is(err, clusterauth.ErrBadSignature):
		why = "its signature does not match, or it was signed for another server"
	case errors.Is(err, clusterauth.ErrReplayed):
		why = "it was received before (a signed request is good once)"
	case errors.Is(err, clusterauth.ErrStale):
		why = "its signing time is too far from this server's clock"
	}
	return &openai.Error{Status: http.StatusUnauthorized, Type: openai.TypeInvalidRequest, Param: "bootstrap_room",
		Message: "PD requests (with bootstrap_room) must be signed with the cluster secret, that is, come through the cluster's router: " + why}
}
