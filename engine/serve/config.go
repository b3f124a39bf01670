package serve

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/clock"
	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/kernels"
)

// Config sizes an Engine. Zero values take the defaults noted per field.
type Config struct {
	TP int // tensor-parallel ranks (default 1); must divide the head counts
	// Backend gives each rank its kernels (required): the caller picks
	// the backend (CPU with its threads, CUDA) and the engine owns what it
	// returns, closing backends that have a Close method.
	Backend func(rank int) kernels.Backend `json:"-"`

	PageSize int // tokens per KV page (default 16)
	KVTokens int // KV capacity per rank in tokens (default: from KVMemory, else MaxRunning × context length)
	// KVMemory, when KVTokens is 0, sizes every rank's KV pool from a
	// memory budget for the whole server's pools, in bytes: each rank
	// takes its share (KVMemory / TP) and holds as many whole pages as
	// fit, at the bytes a token takes in its pool (K and V or the latent,
	// and index-K, every layer, in KVType).
	KVMemory       int64
	MaxRunning     int                 // admitted requests at most (default 8)
	MaxBatchTokens int                 // tokens per step, prefill and decode together (default 512); at least MaxRunning
	PrefillChunk   int                 // prompt tokens per request per step (default 256)
	IndexK         kernels.IndexKDType // index-K precision for models with an indexer
	// KVType is the element type every rank's pool stores K and V in:
	// kernels.F32 (the zero value, the default), kernels.BF16 or
	// kernels.F16. A 16-bit pool holds twice the tokens in the same memory
	// and moves half the bytes per token in a PD transfer; a prefill and a
	// decode must agree on it (the bootstrap refuses a mismatch), and the
	// host tier follows it.
	KVType kernels.DType

	// DisablePrefixCache turns the radix prefix cache off: every prompt is
	// computed from position 0 and finished sequences free all their pages.
	DisablePrefixCache bool
	// HiCache is the prefix cache's host tier (off by default).
	HiCache HiCacheConfig

	// Schedule is the rank loop: ScheduleLockstep (default) runs each
	// step's forward pass in line; ScheduleOverlap runs the next
	// iteration's front half beside it (overlap.go). ScheduleAuto is
	// resolved to one of them first (ResolveSchedule).
	Schedule string

	// Name labels the loops' goroutines (pprof label server; default
	// "pdserve"). Role is the engine's part: colocated (default), prefill
	// or decode (PD disaggregation, see PDConfig); it is the pprof label
	// role too.
	Name, Role string

	// PD configures the prefill and decode roles.
	PD PDConfig
	// Faults are the fault switches on at start (see FaultBootstrapAbortCrash).
	Faults []string

	// FlightRecorderLen is how many collectives each rank's flight
	// recorder keeps (default dist.DefaultFlightRecorderLen).
	FlightRecorderLen int
	// DecisionLogLen is how many iterations each rank's decision log
	// keeps (default DefaultDecisionLogLen; decisions.go).
	DecisionLogLen int

	// CollectiveWatchdog is the stall threshold of the rank group's
	// watchdog: a collective that waits longer is reported once, with the
	// ranks that have not arrived, to OnStall (default 5s; negative turns
	// the watchdog off).
	CollectiveWatchdog time.Duration
	// OnStall receives the watchdog's reports on the watchdog's goroutine;
	// it must return promptly. Default: a warning through log/slog.
	OnStall func(dist.Stall) `json:"-"`
	// CollectiveTimeout turns on recovery in place (recover.go): when a
	// collective of either communicator has waited this long, or the group
	// broke on a mismatch or the ranks planned different steps, the engine
	// fails the requests in flight, drops the rank group and builds it
	// again with a new boot number, and serves on. 0, the default, turns
	// it off: such a failure stops the engine. It must exceed Heartbeat
	// (idle ranks wait for rank 0 in a collective up to one heartbeat) and
	// CollectiveWatchdog when the watchdog is on (a stall is reported
	// before the group is given up).
	CollectiveTimeout time.Duration

	// CloseTimeout is how long Close waits for the loops to stop at an
	// iteration boundary before it closes the rank group under them
	// (default 5s).
	CloseTimeout time.Duration

	// Timeouts of the scheduler (see sched.Config); zero disables one.
	WaitingTimeout time.Duration
	PrefillTimeout time.Duration
	// RequestTimeout bounds a request's whole life, however long it queues:
	// each of its PD queues and its time in the scheduler (default 10
	// minutes; negative: no limit).
	RequestTimeout time.Duration

	// Heartbeat is how long the loop waits for work before it iterates
	// anyway (expiring timeouts and proving it is alive); default 50ms.
	Heartbeat time.Duration

	// Clock is the engine's time (default clock.Real): every timeout,
	// lease, heartbeat age and watchdog threshold is judged on it, and
	// the records and observer times are stamped with it. A test passes a
	// clock.Manual and advances it to reach a timeout without waiting.
	// The loops' pacing (the heartbeat wake-up, the supervisor's and the
	// watchdog's checks) stays on real timers: those only wake a loop,
	// whose decision then reads this clock. Close's bound is on it too:
	// on a Manual clock, a Close that finds a loop stuck waits until the
	// clock passes CloseTimeout.
	Clock clock.Clock `json:"-"`

	// Logger receives the engine's warnings (a PD failure, once, by the
	// rank that decided it; a stalled collective); default slog.Default().
	Logger *slog.Logger `json:"-"`

	// Observer, when set, is told of every emitted token, finished
	// request and forward step. Rank 0's loop calls it, never from two
	// goroutines at once, with timestamps it took itself, so it must return at once and never
	// block (updating counters and histograms is fine).
	Observer Observer `json:"-"`
}

// Observer watches the loop for metrics. See Config.Observer.
type Observer interface {
	// TokenEmitted reports request id's n-th generated token (n counts
	// from 1). For n == 1, since is the time to first token (from Submit);
	// after that it is the time since the request's previous token.
	TokenEmitted(id uint64, n int, since time.Duration)
	// RequestFinished reports a request's end, whatever the reason
	// (requests refused at admission and ended by Close included).
	RequestFinished(id uint64, f Finish)
	// StepFinished reports an iteration that ran a forward step.
	StepFinished(rec StepRecord)
}

func (c *Config) setDefaults(m *model.Model) {
	if c.TP == 0 {
		c.TP = 1
	}
	if c.PageSize == 0 {
		c.PageSize = 16
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = 8
	}
	if c.KVTokens == 0 && m != nil {
		if c.KVMemory > 0 {
			c.KVTokens = c.tokensIn(m, c.KVMemory)
		} else {
			c.KVTokens = c.MaxRunning * m.Config.ContextLen
		}
	}
	if c.MaxBatchTokens == 0 {
		c.MaxBatchTokens = max(512, c.MaxRunning)
	}
	if c.PrefillChunk == 0 {
		c.PrefillChunk = 256
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = 50 * time.Millisecond
	}
	if c.Clock == nil {
		c.Clock = clock.Real{}
	}
	if c.Name == "" {
		c.Name = "pdserve"
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 10 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Role == "" {
		c.Role = pdproto.RoleColocated
	}
	c.PD.setDefaults()
	c.HiCache.setDefaults()
	if c.Schedule == "" {
		c.Schedule = ScheduleLockstep
	}
	if c.CollectiveWatchdog == 0 {
		c.CollectiveWatchdog = 5 * time.Second
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 5 * time.Second
	}
	if c.DecisionLogLen == 0 {
		c.DecisionLogLen = DefaultDecisionLogLen
	}
}

// maxSeqs is the number of sequences a rank's pool holds at once: the
// running requests, and on a colocated or decode server as many again whose
// KV waits for admission (a decode's transfers, the forked samples of a
// request with n > 1).
func (c Config) maxSeqs() int {
	if c.Role == pdproto.RolePrefill {
		return c.MaxRunning
	}
	return 2 * c.MaxRunning
}

// Pages is the number of KV pages of each rank's pool.
func (c Config) Pages() int {
	if c.PageSize < 1 {
		return 0
	}
	return (c.KVTokens + c.PageSize - 1) / c.PageSize
}

// tokenBytes is what one token takes in one rank's pool of model m.
func (c *Config) tokenBytes(m *model.Model) int64 {
	pc := m.ShardPoolConfig(max(c.TP, 1), max(c.PageSize, 1), 1, 1, c.IndexK)
	pc.KVType = c.KVType
	return pc.TokenBytes()
}

// tokensIn is the KV capacity per rank, in whole pages, that a budget of
// bytes for every rank's pool together holds.
func (c *Config) tokensIn(m *model.Model, bytes int64) int {
	tb, ps := c.tokenBytes(m), int64(max(c.PageSize, 1))
	if tb <= 0 {
		return 0
	}
	tokens := bytes / int64(max(c.TP, 1)) / tb / ps * ps
	return int(min(tokens, 1<<31-1))
}

// validatePool checks the KV pool's shape: its page size, element type
// and capacity, by tokens or by a memory budget.
func (c Config) validatePool(m *model.Model, bad func(string, ...any)) {
	if c.PageSize < 1 {
		bad("page size %d (--page-size) must be positive", c.PageSize)
	}
	switch c.KVType {
	case kernels.F32, kernels.BF16, kernels.F16:
	default:
		bad("KV type %v (--kv-dtype): want f32, bf16 or f16", c.KVType)
	}
	switch {
	case c.KVTokens < 1 && c.KVMemory > 0 && m != nil:
		bad("a KV memory of %d bytes (--kv-memory) holds no page of %d tokens on each of %d ranks (%d bytes a token)",
			c.KVMemory, c.PageSize, max(c.TP, 1), c.tokenBytes(m))
	case c.KVTokens < 1:
		bad("KV capacity of %d tokens (--kv-tokens) must be positive", c.KVTokens)
	}
}

// Validate refuses impossible combinations, after defaults, for model m
// (nil skips the model checks). It is the one check of these settings:
// pdserve's engine commands pass its error on as a usage error, unchanged,
// so each error names a setting the commands take as a flag by that flag
// ("page size 0 (--page-size)"; CollectiveWatchdog is --stall-after), and
// a setting no flag sets by its field. The PD machine's settings are
// checked by the machine's own rules (rooms.Config.Validate), in its words.
func (c Config) Validate(m *model.Model) error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("serve: "+format, args...)) }
	if c.TP < 1 {
		bad("tp %d (--tp) must be positive", c.TP)
	} else if m != nil {
		if err := m.Config.CheckShards(c.TP); err != nil {
			bad("tp %d (--tp): %v", c.TP, err)
		}
	}
	if c.Backend == nil {
		bad("no kernel backend (Config.Backend)")
	}
	c.validatePool(m, bad)
	if c.MaxRunning < 1 {
		bad("max running %d (--max-running) must be positive", c.MaxRunning)
	}
	if c.MaxBatchTokens < c.MaxRunning {
		bad("batch tokens %d (--max-batch-tokens) below max running %d (--max-running): a decode step of every running request could not fit", c.MaxBatchTokens, c.MaxRunning)
	}
	if c.PrefillChunk < 1 {
		bad("prefill chunk %d (--prefill-chunk) must be positive", c.PrefillChunk)
	}
	if c.WaitingTimeout < 0 || c.PrefillTimeout < 0 {
		bad("waiting and prefill timeouts %v, %v (--waiting-timeout, --prefill-timeout) must not be negative (0: no limit)", c.WaitingTimeout, c.PrefillTimeout)
	}
	if c.Heartbeat <= 0 {
		bad("heartbeat %v must be positive", c.Heartbeat)
	}
	c.HiCache.validate(c.DisablePrefixCache, c.Role, bad)
	switch c.Schedule {
	case ScheduleLockstep, ScheduleOverlap:
	case ScheduleAuto:
		bad("schedule %q (--schedule): an engine runs %s or %s; ResolveSchedule picks one", c.Schedule, ScheduleLockstep, ScheduleOverlap)
	default:
		bad("schedule %q (--schedule): want %s or %s", c.Schedule, ScheduleLockstep, ScheduleOverlap)
	}
	if c.CollectiveWatchdog > 0 && c.Heartbeat >= c.CollectiveWatchdog {
		bad("heartbeat %v must be shorter than the collective watchdog %v (--stall-after): idle ranks wait for rank 0 in a collective up to one heartbeat", c.Heartbeat, c.CollectiveWatchdog)
	}
	// Recovery gives a collective up: not before a healthy one may still
	// arrive (idle ranks wait up to one heartbeat), nor before the
	// watchdog, when on, has reported it stalled.
	if c.CollectiveTimeout < 0 || (c.CollectiveTimeout > 0 && (c.CollectiveTimeout <= c.Heartbeat || c.CollectiveTimeout <= c.CollectiveWatchdog)) {
		watchdog := "off"
		if c.CollectiveWatchdog > 0 {
			watchdog = c.CollectiveWatchdog.String()
		}
		bad("collective timeout %v (--collective-timeout) must exceed the collective watchdog %s (--stall-after) and the heartbeat %v: a collective is reported stalled, and given a heartbeat to arrive, before recovery gives it up (0 turns recovery off)",
			c.CollectiveTimeout, watchdog, c.Heartbeat)
	}
	switch c.Role {
	case pdproto.RoleColocated, pdproto.RolePrefill, pdproto.RoleDecode:
	default:
		bad("role %q: want colocated, prefill or decode", c.Role)
	}
	if err := c.PD.validate(); err != nil {
		bad("%v", err)
	} else if (c.Role == pdproto.RolePrefill || c.Role == pdproto.RoleDecode) && c.TP >= 1 && c.PageSize >= 1 {
		// Every rank's machine gets this, but its rank: the highest is
		// the one a rank's range could refuse. The TP size and the page
		// size are refused above, not asked of the machine again.
		ik := ""
		if m != nil && m.Config.Indexer != nil {
			ik = indexKName(c.IndexK)
		}
		if err := c.roomsConfig(c.TP-1, ik).Validate(); err != nil {
			errs = append(errs, fmt.Errorf("serve: %w", err))
		}
	}
	for _, f := range c.Faults {
		if err := checkFault(f, c.Role); err != nil {
			bad("%v (--fault)", err)
		}
	}
	if c.CloseTimeout <= 0 {
		bad("close timeout %v must be positive", c.CloseTimeout)
	}
	if c.FlightRecorderLen < 0 {
		bad("flight recorder length %d must not be negative", c.FlightRecorderLen)
	}
	if c.DecisionLogLen < 0 {
		bad("decision log length %d must not be negative", c.DecisionLogLen)
	}
	if c.PageSize >= 1 && c.KVTokens >= 1 && c.MaxRunning >= 1 && c.Pages() < c.MaxRunning {
		bad("KV pool of %d pages cannot hold %d running requests (one page each at least): raise the KV capacity (--kv-tokens) or lower max running (--max-running)", c.Pages(), c.MaxRunning)
	}
	return errors.Join(errs...)
}
