// Package httpx is the HTTP plumbing pdkit's servers share: a mux that
// routes "METHOD /path", answers unknown paths (404) and wrong methods (405
// with Allow) with OpenAI-style error bodies, recovers a handler's panic
// into a logged 500, and logs each request at debug level; and JSON
// answers.
package httpx

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/pdkit/pdkit/api/openai"
)

// Mux is an http.Handler. Register routes before serving.
type Mux struct {
	mux     *http.ServeMux
	methods map[string]string // path -> its method, for 405 answers
	log     *slog.Logger
}

// NewMux returns an empty Mux that logs to log.
func NewMux(log *slog.Logger) *Mux {
	m := &Mux{mux: http.NewServeMux(), methods: map[string]string{}, log: log}
	m.mux.HandleFunc("/", m.NotFound)
	return m
}

// Handle routes method and path to h.
func (m *Mux) Handle(method, path string, h http.HandlerFunc) {
	m.methods[path] = method
	m.mux.HandleFunc(method+" "+path, h)
}

// HandlePrefix routes every method of every path under prefix (ending in
// "/") to h, which answers for itself.
func (m *Mux) HandlePrefix(prefix string, h http.Handler) { m.mux.Handle(prefix, h) }

// NotFound answers a path with no route (404), or a route with another
// method (405 and Allow).
func (m *Mux) NotFound(w http.ResponseWriter, r *http.Request) {
	if method, ok := m.methods[r.URL.Path]; ok {
		w.Header().Set("Allow", method)
		(&openai.Error{Status: http.StatusMethodNotAllowed, Type: openai.TypeInvalidRequest,
			Message: fmt.Sprintf("method %s not allowed on %s; use %s", r.Method, r.URL.Path, method)}).WriteJSON(w)
		return
	}
	(&openai.Error{Status: http.StatusNotFound, Type: openai.TypeInvalidRequest,
		Message: fmt.Sprintf("no route %s %s", r.Method, r.URL.Path)}).WriteJSON(w)
}

// ServeHTTP serves r, turning a handler panic into a logged 500 (when the
// response has not begun; else the connection is cut).
func (m *Mux) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rw := &Recorder{ResponseWriter: w}
	start := time.Now()
	defer func() {
		v := recover()
		if v == nil {
			m.log.Debug("request", "method", r.Method, "path", r.URL.Path, "status", rw.Status, "duration", time.Since(start))
			return
		}
		if v == http.ErrAbortHandler {
			panic(v)
		}
		m.log.Error("handler panic", "method", r.Method, "path", r.URL.Path, "panic", fmt.Sprint(v))
		if !rw.Wrote {
			openai.ServerError("internal error").WriteJSON(rw)
		}
	}()
	m.mux.ServeHTTP(rw, r)
}

// Recorder notes whether a response has begun, and its status.
type Recorder struct {
	http.ResponseWriter
	Wrote  bool
	Status int
}

func (w *Recorder) WriteHeader(code int) {
	if !w.Wrote {
		w.Wrote, w.Status = true, code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *Recorder) Write(b []byte) (int, error) {
	if !w.Wrote {
		w.Wrote, w.Status = true, http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *Recorder) Flush() {
	if !w.Wrote {
		w.Wrote, w.Status = true, http.StatusOK
	}
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap gives http.ResponseController the writer underneath.
func (w *Recorder) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// WriteJSON answers v as JSON with status (a 500 if v does not encode).
func WriteJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		openai.ServerError(err.Error()).WriteJSON(w)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}
