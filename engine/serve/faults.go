package serve

import (
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/pdkit/pdkit/api/pdproto"
)

// Fault switches: real code paths, off by default, that reproduce the
// failures this toolkit is built to diagnose. Each is on or off for the
// whole engine, from Config.Faults at start and Engine.SetFault live.
const (
	// FaultBootstrapAbortCrash makes a prefill rank's control loop treat
	// ABORT as an unknown message and exit, as the reference system's
	// bootstrap thread did: from then on the rank hears no TRANSFER_INFO,
	// so new requests wait in the bootstrap queue on the prefill and in the
	// transfer queue on the decode until their timeouts.
	FaultBootstrapAbortCrash = "bootstrap-abort-crash"
)

// FaultInfo describes one fault switch.
type FaultInfo struct {
	Name  string
	Roles []string // the roles whose code path it changes
	Doc   string
	On    bool
}

var faultSpecs = []FaultInfo{
	{Name: FaultBootstrapAbortCrash, Roles: []string{pdproto.RolePrefill},
		Doc: "the prefill control loop treats ABORT as an unknown message and exits (the mass-abort wedge)"},
}

// faultSet holds the switches' states.
type faultSet struct {
	on [1]atomic.Bool // indexed like faultSpecs
}

func faultIndex(name string) int {
	return slices.IndexFunc(faultSpecs, func(f FaultInfo) bool { return f.Name == name })
}

func (f *faultSet) enabled(name string) bool {
	i := faultIndex(name)
	return i >= 0 && f.on[i].Load()
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

// SetFault switches fault name on or off, live.
func (e *Engine) SetFault(name string, on bool) error {
	if err := checkFault(name, e.cfg.Role); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	e.faults.on[faultIndex(name)].Store(on)
	return nil
}

// Faults lists every fault switch with its state on this engine (those of
// other roles listed as off).
func (e *Engine) Faults() []FaultInfo {
	out := slices.Clone(faultSpecs)
	for i := range out {
		out[i].On = e.faults.on[i].Load()
	}
	return out
}
