package serve

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// Fault switches: real code paths, off by default, that reproduce the
// failures this toolkit is built to diagnose, and generic chaos switches
// beside them. Each is on or off for the whole engine, from Config.Faults
// at start and Engine.SetFault live.
const (
	// FaultBootstrapAbortCrash makes a prefill rank's control loop treat
	// ABORT as an unknown message and exit, as the reference system's
	// bootstrap thread did: from then on the rank hears no TRANSFER_INFO,
	// so new requests wait in the bootstrap queue on the prefill and in the
	// transfer queue on the decode until their timeouts.
	FaultBootstrapAbortCrash = "bootstrap-abort-crash"

	// FaultStallLastRank holds the highest TP rank at the top of its next
	// iteration until the switch goes off: its peers wait in their next
	// collective for it (the watchdog reports the stall, the flight
	// recorders show the ranks apart), and the server stops progressing
	// while every rank is alive.
	FaultStallLastRank = "stall-last-rank"

	// FaultPDLoopExit ends a PD rank's receive loop (control on a prefill,
	// KV on a decode) at its next message, whatever the message.
	FaultPDLoopExit = "pd-loop-exit"

	// FaultOverlapLocalDecision makes the highest TP rank of a prefill or
	// decode server, in the overlap loop, decide run-or-idle from its own
	// PD socket mail instead of the agreed state: when its mailbox filed
	// nothing for it since its last iteration it takes the idle branch,
	// skipping the iteration's poll, admit and room, while its peers, on
	// the agreed state, enter the poll. The group breaks as in incident 2
	// (overlap.go, rankPD.localIdle). The lock-step loop has no such branch.
	FaultOverlapLocalDecision = "overlap-local-decision"
)

// faultDelay is how long a delay-* switch holds each message of its type in
// the receive loop before filing it, as a slow link would.
const faultDelay = 250 * time.Millisecond

// FaultDrop and FaultDelay name the switches that drop, or delay by
// faultDelay, every received message of type t: "drop-kv-chunk",
// "delay-heartbeat" and so on. A dropped message is counted (reason fault).
func FaultDrop(t pdproto.Type) string  { return "drop-" + typeSlug(t) }
func FaultDelay(t pdproto.Type) string { return "delay-" + typeSlug(t) }

func typeSlug(t pdproto.Type) string { return strings.ToLower(strings.ReplaceAll(string(t), "_", "-")) }

// FaultInfo describes one fault switch.
type FaultInfo struct {
	Name  string
	Roles []string // the roles whose code path it changes
	Doc   string
	On    bool
}

// receivers are the roles that receive each message type.
var receivers = map[pdproto.Type][]string{
	pdproto.TypeTransferInfo: {pdproto.RolePrefill},
	pdproto.TypeKVChunk:      {pdproto.RoleDecode},
	pdproto.TypeStatus:       {pdproto.RolePrefill, pdproto.RoleDecode},
	pdproto.TypeAbort:        {pdproto.RolePrefill},
	pdproto.TypeAbortAck:     {pdproto.RoleDecode},
	pdproto.TypeHeartbeat:    {pdproto.RolePrefill, pdproto.RoleDecode},
	pdproto.TypeQueued:       {pdproto.RolePrefill},
}

var faultSpecs = func() []FaultInfo {
	all := []string{pdproto.RoleColocated, pdproto.RolePrefill, pdproto.RoleDecode}
	pd := []string{pdproto.RolePrefill, pdproto.RoleDecode}
	specs := []FaultInfo{
		{Name: FaultBootstrapAbortCrash, Roles: []string{pdproto.RolePrefill},
			Doc: "the prefill control loop treats ABORT as an unknown message and exits (the mass-abort wedge)"},
		{Name: FaultStallLastRank, Roles: all,
			Doc: "the highest TP rank stops before its next collective until switched off; its peers wait in the collective"},
		{Name: FaultPDLoopExit, Roles: pd,
			Doc: "each rank's PD receive loop (prefill control, decode KV) exits at its next message"},
		{Name: FaultOverlapLocalDecision, Roles: pd,
			Doc: "in the overlap loop the highest TP rank takes the idle branch when its own PD socket filed no mail since its last iteration, while its peers enter the agreed poll: a collective mismatch or a hang (the overlap-schedule desync)"},
		{Name: FaultHiCacheIndexKUngated, Roles: []string{pdproto.RoleColocated, pdproto.RolePrefill},
			Doc: "each layer of a prefix loading back from host waits once, as it begins, for its KV alone, and the sparse indexer then reads index-K without waiting for the layer's index-K, which lands after the KV (the HiCache index-K race)"},
	}
	for _, t := range pdproto.Types {
		specs = append(specs, FaultInfo{Name: FaultDrop(t), Roles: receivers[t],
			Doc: fmt.Sprintf("every %s received is dropped (counted, reason fault)", t)})
	}
	for _, t := range pdproto.Types {
		specs = append(specs, FaultInfo{Name: FaultDelay(t), Roles: receivers[t],
			Doc: fmt.Sprintf("every %s received waits %v in the receive loop before it is filed", t, faultDelay)})
	}
	return specs
}()

// faultSet holds the switches' states; changed is closed and replaced at
// every change, to wake the loops that wait for a switch to go off.
type faultSet struct {
	on      [maxFaults]atomic.Bool // indexed like faultSpecs
	count   atomic.Int32           // switches on: the receive path's one load while none is
	mu      sync.Mutex
	changed chan struct{}
}

// The switches the receive path checks per message, by index.
var (
	idxPDLoopExit          = faultIndex(FaultPDLoopExit)
	idxBootstrapAbortCrash = faultIndex(FaultBootstrapAbortCrash)
	idxOverlapLocal        = faultIndex(FaultOverlapLocalDecision)
	idxDrop, idxDelay      = typeIndex(FaultDrop), typeIndex(FaultDelay)
)

func typeIndex(name func(pdproto.Type) string) map[pdproto.Type]int {
	m := map[pdproto.Type]int{}
	for _, t := range pdproto.Types {
		m[t] = faultIndex(name(t))
	}
	return m
}

// onAt reports whether switch i (an index of faultSpecs, -1 for none) is on.
func (f *faultSet) onAt(i int) bool { return i >= 0 && f.on[i].Load() }

// receiving is what the switches do to a received message of type t: end
// the loop, drop it, or delay it.
func (f *faultSet) receiving(t pdproto.Type) (exit, drop, delay bool) {
	if f.count.Load() == 0 {
		return false, false, false
	}
	return f.onAt(idxPDLoopExit), f.onAt(idxDrop[t]), f.onAt(idxDelay[t])
}

// maxFaults bounds the number of switches (checked by TestFaultList).
const maxFaults = 32

func faultIndex(name string) int {
	return slices.IndexFunc(faultSpecs, func(f FaultInfo) bool { return f.Name == name })
}

func (f *faultSet) enabled(name string) bool { return f.onAt(faultIndex(name)) }

func (f *faultSet) set(i int, on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.on[i].Swap(on) != on {
		if on {
			f.count.Add(1)
		} else {
			f.count.Add(-1)
		}
	}
	if f.changed != nil {
		close(f.changed)
	}
	f.changed = make(chan struct{})
}

// change returns a channel closed at the next change of any switch.
func (f *faultSet) change() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.changed == nil {
		f.changed = make(chan struct{})
	}
	return f.changed
}

// waitOff blocks while fault name is on, until stop closes; it reports
// whether it waited.
func (f *faultSet) waitOff(name string, stop <-chan struct{}) bool {
	if !f.enabled(name) {
		return false // the loops' path: one atomic load
	}
	waited := false
	for {
		ch := f.change()
		if !f.enabled(name) {
			return waited
		}
		waited = true
		select {
		case <-ch:
		case <-stop:
			return waited
		}
	}
}

// checkFault says whether name is a fault that applies to role.
func checkFault(name, role string) error {
	i := faultIndex(name)
	if i < 0 {
		names := make([]string, len(faultSpecs))
		for j, f := range faultSpecs {
			names[j] = f.Name
		}
		return fmt.Errorf("unknown fault %q (known: %v)", name, names)
	}
	if !slices.Contains(faultSpecs[i].Roles, role) {
		return fmt.Errorf("fault %q applies to %v servers, this one is %s", name, faultSpecs[i].Roles, role)
	}
	return nil
}

// FaultRoles returns the roles whose servers take fault name; false for an
// unknown fault.
func FaultRoles(name string) ([]string, bool) {
	i := faultIndex(name)
	if i < 0 {
		return nil, false
	}
	return slices.Clone(faultSpecs[i].Roles), true
}
