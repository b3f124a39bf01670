package router

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/openai"
	"github.com/prometheus/client_golang/prometheus"
)

// The router's pause (POST /admin/v1/pause, /admin/v1/resume).
//
// The router is where every prefill and decode pair is formed. While it is
// paused it forms none: a new request waits at the edge (queued, its client
// still connected, its context honoured) and the requests admitted before
// the pause run to their end. Once none is left in flight, nothing the
// router sent holds a room on any server, and an operator can change what
// both sides of a pair must agree on (the index-K precision: the handshake
// refuses a prefill and a decode that disagree) on every server at once;
// on resume, every request meets servers that agree. A live index-K switch
// through pdctl runs this way (pdctl indexk set), as SGLang pauses
// generation around a weight update.
//
// A pause has a lease: a caller that dies mid-switch cannot leave the
// cluster closed; the router resumes by itself once the lease has ended.

// pauseState is the pause as a machine: events in, state out, no clock (the
// caller gives the time) and no goroutines.
type pauseState struct {
	paused       bool
	since, until time.Time // the pause began; it ends by itself then
	inFlight     int       // requests admitted and not ended
	waiting      int       // requests waiting at the edge now
	held         uint64    // requests that waited during this pause
}

// expire ends a pause whose lease has ended by now, and reports whether it
// did.
func (p *pauseState) expire(now time.Time) bool {
	if p.paused && !now.Before(p.until) {
		p.paused = false
		return true
	}
	return false
}

// admit admits a request at now, unless the router is paused.
func (p *pauseState) admit(now time.Time) bool {
	p.expire(now)
	if p.paused {
		return false
	}
	p.inFlight++
	return true
}

// pause pauses admission at now until now+lease at least (a second pause
// extends the first's lease), and reports whether the pause is new.
func (p *pauseState) pause(now time.Time, lease time.Duration) bool {
	p.expire(now)
	fresh := !p.paused
	if fresh {
		p.paused, p.since, p.until, p.held = true, now, now.Add(lease), 0
	} else if u := now.Add(lease); u.After(p.until) {
		p.until = u
	}
	return fresh
}

// resume ends the pause at now: false when there was none.
func (p *pauseState) resume(now time.Time) bool {
	p.expire(now)
	was := p.paused
	p.paused = false
	return was
}

// gate runs pauseState for the router's handlers: the waits are channels
// that close when the state changes.
type gate struct {
	mu      sync.Mutex
	s       pauseState
	opened  chan struct{} // closed when the pause ends; nil when not paused
	drained chan struct{} // closed once nothing is in flight during the pause
	now     func() time.Time
}

func newGate() *gate { return &gate{now: time.Now} }

// open closes the pause's channel once the state has left it. g.mu held.
func (g *gate) open() {
	if !g.s.paused && g.opened != nil {
		close(g.opened)
		g.opened = nil
	}
}

// enter admits a request, waiting while the router is paused: until the
// pause ends (a resume, or its lease) or ctx does (the client went), when
// it returns ctx's error. waited says the request waited at the edge. Each
// enter that returns nil is ended by one leave.
func (g *gate) enter(ctx context.Context) (waited bool, err error) {
	for {
		g.mu.Lock()
		now := g.now()
		if g.s.admit(now) {
			g.open()
			if waited {
				g.s.waiting--
			}
			g.mu.Unlock()
			return waited, nil
		}
		if !waited {
			waited = true
			g.s.waiting++
			g.s.held++
		}
		opened, left := g.opened, g.s.until.Sub(now)
		g.mu.Unlock()
		t := time.NewTimer(left)
		select {
		case <-opened:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			g.mu.Lock()
			g.s.waiting--
			g.mu.Unlock()
			return true, ctx.Err()
		}
		t.Stop()
	}
}

// leave ends a request that enter admitted.
func (g *gate) leave() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.s.inFlight--
	g.noteDrained()
}

// noteDrained closes the pause's drained channel once nothing is in
// flight. g.mu held.
func (g *gate) noteDrained() {
	if g.s.paused && g.s.inFlight == 0 && g.drained != nil {
		close(g.drained)
		g.drained = nil
	}
}

// pause pauses admission for lease and returns a channel closed once the
// requests admitted before it have ended (closed already when none is in
// flight; nil when the pause was already drained).
func (g *gate) pause(lease time.Duration) <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.open() // a lease that has ended closes its channel first
	if g.s.pause(g.now(), lease) {
		g.opened, g.drained = make(chan struct{}), make(chan struct{})
	}
	d := g.drained
	g.noteDrained()
	return d
}

// resume ends the pause: the requests waiting are admitted. It returns
// whether there was a pause, how long it lasted and how many requests
// waited during it.
func (g *gate) resume() (bool, time.Duration, uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	since, held := g.s.since, g.s.held
	was := g.s.resume(now)
	g.open()
	g.drained = nil
	return was, now.Sub(since), held
}

// status is the pause as /debug/v1/cluster shows it: whether the router
// is paused, for how long still at most, the requests waiting and in
// flight.
func (g *gate) status() (paused bool, left time.Duration, waiting, inFlight int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	g.s.expire(now)
	g.open()
	return g.s.paused, g.s.until.Sub(now), g.s.waiting, g.s.inFlight
}

// adminRoutes registers the router's admin calls, each under the admin
// rule.
func (rt *Router) adminRoutes() {
	guarded := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if oerr := rt.opts.Admin.Check(w, r); oerr != nil {
				rt.log.Info("admin call refused", "remote", r.RemoteAddr, "path", r.URL.Path, "status", oerr.Status, "err", oerr.Message)
				oerr.WriteJSON(w)
				return
			}
			h(w, r)
		}
	}
	rt.handle("POST", debug.PausePath, guarded(rt.pauseCall))
	rt.handle("POST", debug.ResumePath, guarded(rt.resumeCall))
}

// durationParam reads the duration query parameter name: def when absent,
// else at least 0 and at most most.
func durationParam(r *http.Request, name string, def, most time.Duration) (time.Duration, *openai.Error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 || d > most {
		return 0, openai.InvalidRequest(name, fmt.Sprintf("%s %q: want a duration from 0 to %v, such as 30s or 2m", name, v, most))
	}
	return d, nil
}

// pauseCall serves POST /admin/v1/pause.
func (rt *Router) pauseCall(w http.ResponseWriter, r *http.Request) {
	lease, oerr := durationParam(r, "lease", debug.PauseDefaultLease, debug.PauseMaxLease)
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	if lease == 0 {
		openai.InvalidRequest("lease", "lease 0: a pause needs a lease, after which the router resumes by itself").WriteJSON(w)
		return
	}
	drain, oerr := durationParam(r, "drain", 0, debug.PauseMaxLease)
	if oerr != nil {
		oerr.WriteJSON(w)
		return
	}
	start := time.Now()
	drained := rt.gate.pause(lease)
	rt.log.Info("admission paused", "remote", r.RemoteAddr, "lease", lease, "drain", drain)
	if drained != nil { // nil: a pause drained already
		t := time.NewTimer(drain)
		select {
		case <-drained:
		case <-t.C:
		case <-r.Context().Done():
		}
		t.Stop()
	}
	_, left, _, inFlight := rt.gate.status()
	writeJSON(w, http.StatusOK, debug.PauseResponse{InFlight: inFlight, Drained: inFlight == 0,
		WaitedMS: ms(time.Since(start)), LeaseMS: ms(max(0, left))})
}

// resumeCall serves POST /admin/v1/resume.
func (rt *Router) resumeCall(w http.ResponseWriter, r *http.Request) {
	was, lasted, held := rt.gate.resume()
	resp := debug.ResumeResponse{Resumed: was}
	if was {
		resp.PausedMS, resp.Held = ms(lasted), held
		rt.log.Info("admission resumed", "remote", r.RemoteAddr, "paused", lasted, "held", held)
	}
	writeJSON(w, http.StatusOK, resp)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// pauseCollector exports the pause: whether the router is paused and the
// requests waiting at its edge.
type pauseCollector struct{ g *gate }

var (
	pausedDesc = prometheus.NewDesc("pdkit_router_paused",
		"1 while an operator has paused admission (POST /admin/v1/pause): new requests wait at the edge", nil, nil)
	waitingDesc = prometheus.NewDesc("pdkit_router_paused_waiting_requests",
		"requests waiting at the edge for a pause to end", nil, nil)
)

func (c pauseCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- pausedDesc
	ch <- waitingDesc
}

func (c pauseCollector) Collect(ch chan<- prometheus.Metric) {
	paused, _, waiting, _ := c.g.status()
	v := 0.0
	if paused {
		v = 1
	}
	ch <- prometheus.MustNewConstMetric(pausedDesc, prometheus.GaugeValue, v)
	ch <- prometheus.MustNewConstMetric(waitingDesc, prometheus.GaugeValue, float64(waiting))
}
