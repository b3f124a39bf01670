package diag

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
)

// Severity says how urgently a finding needs an operator.
type Severity int

// The severities, from the least to the most urgent.
const (
	Info Severity = iota + 1
	Warning
	Critical
)

func (s Severity) String() string {
	switch s {
	case Info:
		return "info"
	case Warning:
		return "warning"
	case Critical:
		return "critical"
	}
	return fmt.Sprintf("severity(%d)", int(s))
}

// MarshalText writes the severity's name.
func (s Severity) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText reads a severity's name.
func (s *Severity) UnmarshalText(b []byte) error {
	for _, v := range []Severity{Info, Warning, Critical} {
		if v.String() == string(b) {
			*s = v
			return nil
		}
	}
	return fmt.Errorf("diag: unknown severity %q", b)
}

// Server is one server of the cluster as pdctl found it.
type Server struct {
	URL    string `json:"url"`
	Role   string `json:"role"` // prefill, decode or colocated
	TPSize int    `json:"tp_size"`
}

// ServerSample is what pdctl read from one server at one instant: its debug
// API answers, each nil when the server did not give it (a colocated server
// has no PD answer; an unreachable one has none).
type ServerSample struct {
	Server
	Reachable bool `json:"reachable"`
	// Error says why the server could not be read; empty when reachable.
	Error       string                     `json:"error,omitempty"`
	Steps       *debug.StepsResponse       `json:"steps,omitempty"`
	Collectives *debug.CollectivesResponse `json:"collectives,omitempty"`
	Requests    *debug.RequestsResponse    `json:"requests,omitempty"`
	PD          *debug.PDResponse          `json:"pd,omitempty"`
	Faults      *debug.FaultsResponse      `json:"faults,omitempty"`
	// Settings are what the server published at GET /debug/v1/settings:
	// the rules judge its queues by its own timeouts and heartbeat. Nil
	// from a server that publishes none.
	Settings *debug.Settings `json:"settings,omitempty"`
	// Registry is a prefill server's bootstrap registry as a decode would
	// look it up (GET /bootstrap/v1/ranks at its bootstrap URL); nil on
	// other roles, or when it did not answer a whole group.
	Registry *pdproto.LookupResponse `json:"registry,omitempty"`
	// TookMS is the time the answers took, all together.
	TookMS float64 `json:"took_ms"`
}

// RouterSample is what pdctl read from the router at one instant: the
// counters of its GET /metrics that say how the requests it routed ended.
type RouterSample struct {
	URL       string `json:"url"`
	Reachable bool   `json:"reachable"`
	// Error says why the router could not be read; empty when reachable.
	Error string `json:"error,omitempty"`
	// Outcomes counts the requests the router finished since it started,
	// by outcome (pdkit_router_requests_total: ok, upstream_error,
	// no_server, ...; FailedOutcome says which are failures).
	Outcomes map[string]uint64 `json:"outcomes"`
	// UpstreamErrors counts the failed upstream requests (transport
	// errors and 5xx answers) by server URL
	// (pdkit_router_upstream_errors_total).
	UpstreamErrors map[string]uint64 `json:"upstream_errors"`
	// Paused says an operator has paused the router's admission
	// (pdkit_router_paused; pdctl indexk set pauses it for a switch).
	Paused bool `json:"paused,omitempty"`
	// Canaries counts the router's own canaries (pdkit_router_canaries_total)
	// by prefill server and result (match, mismatch, skipped, failed).
	Canaries map[string]map[string]uint64 `json:"canaries,omitempty"`
	// Ready is the router's GET /readyz: its verdict on its recent
	// requests, state older than the window; nil when it did not answer.
	Ready *debug.RouterReady `json:"ready,omitempty"`
}

// Sample is the cluster at one instant: every server, in a stable order,
// and the router when pdctl found the servers through one.
type Sample struct {
	Taken   time.Time      `json:"taken"`
	Router  *RouterSample  `json:"router,omitempty"`
	Servers []ServerSample `json:"servers"`
}

// Server returns the sample of the server at url, or nil.
func (s Sample) Server(url string) *ServerSample {
	for i := range s.Servers {
		if s.Servers[i].URL == url {
			return &s.Servers[i]
		}
	}
	return nil
}

// Window is the series of samples taken over the diagnose window, oldest
// first. Rules judge at least the first and the last; a window of one
// sample cannot show progress, so rules about progress stay silent on it.
type Window struct {
	Samples []Sample `json:"samples"`
	// Canaries are what diagnose's canaries found during the window (an
	// active probe, sent only with --canaries); nil when none were sent.
	Canaries *Canaries `json:"canaries,omitempty"`
	// DiscoveredAt, when set, says the servers are the ones pdctl last
	// discovered through the router, then: the router did not answer.
	DiscoveredAt *time.Time `json:"discovered_at,omitempty"`
}

// First returns the oldest sample; the zero Sample when there is none.
func (w Window) First() Sample {
	if len(w.Samples) == 0 {
		return Sample{}
	}
	return w.Samples[0]
}

// Last returns the newest sample; the zero Sample when there is none.
func (w Window) Last() Sample {
	if len(w.Samples) == 0 {
		return Sample{}
	}
	return w.Samples[len(w.Samples)-1]
}

// Span is the time between the first and the last sample.
func (w Window) Span() time.Duration { return w.Last().Taken.Sub(w.First().Taken) }

// Evidence is one key/value line of a finding: a number that proves it.
type Evidence struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// Finding is one thing a rule found wrong.
type Finding struct {
	Rule     string   `json:"rule"`
	Severity Severity `json:"severity"`
	// Server is the URL of the server (or router) the finding is about.
	Server string `json:"server"`
	// Rank is the TP rank the finding is about; nil (JSON null) when it
	// is about the whole server.
	Rank     *int       `json:"rank"`
	Summary  string     `json:"summary"`
	Evidence []Evidence `json:"evidence"`
	// Seen says how recent the evidence is: the samples it comes from,
	// or, for state older than the window (a loss, a failure, a
	// readiness window), how long before the last sample.
	Seen   string `json:"seen"`
	Remedy string `json:"remedy"`
}

// AtRank returns a Finding.Rank naming rank r.
func AtRank(r int) *int { return &r }

// Where names what the finding is about: the server's URL, followed by
// " rank N" for a finding about one rank.
func (f Finding) Where() string {
	if f.Rank == nil {
		return f.Server
	}
	return fmt.Sprintf("%s rank %d", f.Server, *f.Rank)
}

// String writes the finding as a block of text: a heading line, the
// evidence indented, then the remedy.
func (f Finding) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s %s: %s\n", f.Severity, f.Rule, f.Where(), f.Summary)
	for _, e := range f.Evidence {
		fmt.Fprintf(&b, "  %s: %s\n", e.Key, e.Value)
	}
	if f.Seen != "" {
		fmt.Fprintf(&b, "  seen: %s\n", f.Seen)
	}
	fmt.Fprintf(&b, "  remedy: %s\n", f.Remedy)
	return b.String()
}

// Rule is one check, shaped like a go/analysis analyzer.
type Rule struct {
	Name string // kebab-case, unique
	Doc  string // one sentence: what it detects and why it matters
	// Severity is the most urgent severity the rule reports.
	Severity Severity
	// Basis is what the rule judges: the window's samples (the zero
	// value) or the last one. RunRules says so in each finding that does
	// not say itself how recent its evidence is (Finding.Seen).
	Basis Basis
	Check func(Window) []Finding
}

// Basis is the samples a rule's findings rest on.
type Basis int

const (
	OverWindow Basis = iota // progress, or its absence, between the samples
	LastSample              // the state in the last sample
)

// seen is how recent evidence on basis b is, in w.
func seen(w Window, b Basis) string {
	if len(w.Samples) == 0 {
		return ""
	}
	if b == LastSample || len(w.Samples) == 1 {
		return "the last sample, " + clock(w.Last().Taken)
	}
	return fmt.Sprintf("the %d samples from %s to %s", len(w.Samples), clock(w.First().Taken), clock(w.Last().Taken))
}

// clock writes t as a UTC time of day.
func clock(t time.Time) string { return t.UTC().Format("15:04:05.0") + " UTC" }

// before says how long before the last sample of w something at t was.
func before(w Window, t time.Time) string {
	return fmt.Sprintf("%s before the last sample (%s)", w.Last().Taken.Sub(t).Round(100*time.Millisecond), clock(t))
}

// Timeouts are PD timeouts: an entry older than its state's timeout should
// have failed. A zero field is unknown.
type Timeouts struct {
	Bootstrap time.Duration // prefill bootstrap queue, decode prealloc queue
	Transfer  time.Duration // decode transfer queue
	Inflight  time.Duration // prefill inflight queue
	AbortAck  time.Duration // decode aborting queue
}

// Config holds the parameters of the rules. The servers' own settings
// (their PD timeouts, their loop heartbeat) come from each ServerSample's
// Settings, not from here.
type Config struct {
	// Overrides replace, field by field, the PD timeouts every server
	// publishes; a zero field keeps the server's.
	Overrides Timeouts
	// Grace is added to every timeout: a rank fails an overdue entry on its
	// next iteration, so an entry may be seen a little past its timeout.
	// LimitsOf raises it to twice a server's loop heartbeat when that is
	// longer.
	Grace time.Duration
	// CollectiveWait is how long a rank may wait in a collective (of
	// either communicator) while a peer is elsewhere before it counts as a
	// desync. Idle ranks wait in the control communicator's step-input
	// broadcast for up to one loop heartbeat, so LimitsOf raises it to
	// twice a server's heartbeat when that is longer.
	CollectiveWait time.Duration
	// LoopStall is how long every rank of a server may go without
	// finishing a step before engine-stalled names it. A loop iterates at
	// least every heartbeat even idle, so LimitsOf raises it to twice a
	// server's heartbeat when that is longer.
	LoopStall time.Duration
	// RecentRestart is how long before the last sample a rank group's
	// rebuild still counts as near the window (engine-restarts names it
	// from the server's last failure even when the window saw none).
	RecentRestart time.Duration
}

// DefaultConfig returns the default parameters: no override of the
// servers' timeouts.
func DefaultConfig() Config {
	return Config{Grace: time.Second, CollectiveWait: 2 * time.Second, LoopStall: time.Second, RecentRestart: 2 * time.Minute}
}

// Limits are the parameters one server is judged by: c's, fitted to the
// settings the server published.
type Limits struct {
	// Timeouts are the server's PD timeouts under c's overrides; a zero
	// field is unknown (no settings published, no override) and the rules
	// judge no queue by it.
	Timeouts                         Timeouts
	Grace, CollectiveWait, LoopStall time.Duration
}

// LimitsOf returns the limits server s is judged by: its published PD
// timeouts, each replaced by c's override when set, and c's grace,
// collective wait and loop stall, each raised to twice the server's loop
// heartbeat when that is longer.
func (c Config) LimitsOf(s *ServerSample) Limits {
	l := Limits{Grace: c.Grace, CollectiveWait: c.CollectiveWait, LoopStall: c.LoopStall}
	if s != nil && s.Settings != nil {
		st := s.Settings
		if pd := st.PD; pd != nil {
			l.Timeouts = Timeouts{Bootstrap: debug.Duration(pd.BootstrapTimeoutMS), Transfer: debug.Duration(pd.TransferTimeoutMS),
				Inflight: debug.Duration(pd.InflightTimeoutMS), AbortAck: debug.Duration(pd.AbortAckTimeoutMS)}
		}
		hb := 2 * debug.Duration(st.HeartbeatMS)
		l.Grace, l.CollectiveWait, l.LoopStall = max(l.Grace, hb), max(l.CollectiveWait, hb), max(l.LoopStall, hb)
	}
	o := c.Overrides
	for _, f := range []struct {
		dst *time.Duration
		v   time.Duration
	}{
		{&l.Timeouts.Bootstrap, o.Bootstrap}, {&l.Timeouts.Transfer, o.Transfer},
		{&l.Timeouts.Inflight, o.Inflight}, {&l.Timeouts.AbortAck, o.AbortAck}} {
		if f.v > 0 {
			*f.dst = f.v
		}
	}
	return l
}

// Rules returns the rules with the default parameters, in a stable order.
func Rules() []Rule { return RulesWith(DefaultConfig()) }

// RulesWith returns the rules with the parameters of c, in a stable order:
// causes before the symptoms they explain (a dead control loop or a lost
// peer before the queues they leave stuck).
func RulesWith(c Config) []Rule {
	return []Rule{
		faultSwitchOn(),
		controlLoopDead(),
		peerUnreachable(),
		routerUnreachable(),
		registryMismatch(),
		configMismatch(),
		modelIdentity(),
		engineStalled(c),
		rankDivergence(c),
		engineRestarts(c),
		pdLinkSlow(),
		pdQueueStuck(),
		pdEntryOverdue(c),
		kvLeak(c),
		requestsFailing(),
		serverSlow(),
		outputDivergence(),
	}
}

// Run runs the default rules over w and returns the findings, sorted.
func Run(w Window) []Finding { return RunRules(Rules(), w) }

// RunRules runs rules over w and returns their findings sorted by severity
// (most urgent first), then by the order of rules (causes first), then
// server, then rank; findings that tie keep the order of each rule's
// output.
func RunRules(rules []Rule, w Window) []Finding {
	var out []Finding
	names := make([]string, len(rules))
	for i, r := range rules {
		names[i] = r.Name
		for _, f := range r.Check(w) {
			if f.Seen == "" {
				f.Seen = seen(w, r.Basis)
			}
			out = append(out, f)
		}
	}
	sortBy(out, names)
	return out
}

// Sort sorts findings as Run returns them.
func Sort(fs []Finding) {
	var names []string
	for _, r := range Rules() {
		names = append(names, r.Name)
	}
	sortBy(fs, names)
}

// sortBy sorts fs by severity, the position of their rule in rules (rules
// not there last), server and rank (the whole server first).
func sortBy(fs []Finding, rules []string) {
	pos := func(f Finding) int {
		if i := slices.Index(rules, f.Rule); i >= 0 {
			return i
		}
		return len(rules)
	}
	slices.SortStableFunc(fs, func(a, b Finding) int {
		return cmp.Or(cmp.Compare(b.Severity, a.Severity), cmp.Compare(pos(a), pos(b)), cmp.Compare(a.Server, b.Server), cmp.Compare(rankKey(a), rankKey(b)))
	})
}

// rankKey orders a server-level finding (no rank) before its ranks'.
func rankKey(f Finding) int {
	if f.Rank == nil {
		return -1
	}
	return *f.Rank
}

// Helpers shared by the rules.

func ev(key string, format string, args ...any) Evidence {
	return Evidence{Key: key, Value: fmt.Sprintf(format, args...)}
}

// ms formats a duration given in milliseconds.
func ms(v float64) string {
	return time.Duration(v * float64(time.Millisecond)).Round(time.Millisecond).String()
}

// list joins the first max values with ", " and says how many more there
// are.
func list[T any](vs []T, max int) string { return listSep(vs, max, ", ") }

// nRooms is "1 room" or "n rooms".
func nRooms(n int) string {
	if n == 1 {
		return "1 room"
	}
	return fmt.Sprintf("%d rooms", n)
}

// listSep is list with another separator.
func listSep[T any](vs []T, max int, sep string) string {
	var parts []string
	for i, v := range vs {
		if i == max {
			parts = append(parts, fmt.Sprintf("… %d more", len(vs)-max))
			break
		}
		parts = append(parts, fmt.Sprint(v))
	}
	return strings.Join(parts, sep)
}

// counts formats a queue-count map in the order of names, skipping zeros.
func counts(m map[string]int, names []string) string {
	var parts []string
	for _, n := range names {
		if m[n] != 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", n, m[n]))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, " ")
}

// pdRank returns the rank of a PD answer, or nil.
func pdRank(p *debug.PDResponse, rank int) *debug.PDRank {
	if p == nil {
		return nil
	}
	for i := range p.Ranks {
		if p.Ranks[i].Rank == rank {
			return &p.Ranks[i]
		}
	}
	return nil
}

// entries returns the entries of one queue of a rank.
func entries(r *debug.PDRank, queue string) []debug.PDEntry {
	if r == nil {
		return nil
	}
	var out []debug.PDEntry
	for _, e := range r.Entries {
		if e.Queue == queue {
			out = append(out, e)
		}
	}
	return out
}

// summarise returns the rooms of es in order and the oldest age.
func summarise(es []debug.PDEntry) (rooms []debug.ID, oldestMS float64) {
	for _, e := range es {
		rooms = append(rooms, e.Room)
		oldestMS = max(oldestMS, e.InQueueMS)
	}
	slices.Sort(rooms)
	return rooms, oldestMS
}

// or is s, or alt when s is empty.
func or(s, alt string) string {
	if s == "" {
		return alt
	}
	return s
}
