package serve

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/kernels"
)

// The operator's live switches: each checks its arguments here, on the
// caller's goroutine, and either sets an atomic the loops read (a fault,
// the loaders' pacing) or puts an op into the inbox for rank 0 to
// broadcast, so that every rank switches in the same iteration.

// SetFault switches fault name on or off, live.
func (e *Engine) SetFault(name string, on bool) error {
	if err := checkFault(name, e.cfg.Role); err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	e.faults.set(faultIndex(name), on)
	e.inbox.poke() // a loop waiting for work sees the change at once
	return nil
}

// SetHiCache turns the host tier on (sized by the configuration, checked
// against the memory available now) or off, live: every rank switches in
// the same iteration. Off lets loads in flight finish, stops backups and
// loads, and frees the host pool; on starts empty. It returns once the
// switch is queued for the loops; View.HiCache shows when it took effect.
func (e *Engine) SetHiCache(on bool) error {
	if why := e.cfg.NoHostTier(); why != "" {
		return errors.New("serve: " + why)
	}
	op := tierOp{off: !on}
	if on {
		pages, err := e.cfg.HiCache.hostPages(e.sup.cur().loops[0].rk.Pool().Config(), e.cfg.TP)
		if err != nil {
			return err
		}
		op.pages = pages
	}
	return e.inbox.putTier(&op)
}

// SetHiCacheBandwidth paces every rank's loader to bytesPerSecond (0:
// unlimited), live.
func (e *Engine) SetHiCacheBandwidth(bytesPerSecond int64) error {
	if bytesPerSecond < 0 {
		return fmt.Errorf("serve: hicache load bandwidth %d: want non-negative (0 is unlimited)", bytesPerSecond)
	}
	e.hicacheBandwidth.Store(bytesPerSecond)
	for _, l := range e.sup.cur().loops {
		if ld := l.tier.loader.Load(); ld != nil {
			ld.SetBandwidth(bytesPerSecond)
		}
	}
	return nil
}

// Offload moves the cached prefix of prompt to every rank's host tier (see
// prefix.Cache.Offload), so that the next request with that prefix loads it
// back: an operator's way to exercise, or to canary, the load-back path. It
// returns the tokens now on host only on rank 0 (every rank offloads the
// same pages; a backup may fail on one rank only, and then that rank drops
// the page instead). The host tier must be on.
func (e *Engine) Offload(ctx context.Context, prompt []int32) (int, error) {
	if ts := e.view.HiCache(); len(ts) == 0 || !ts[0].On {
		return 0, errors.New("serve: offload needs the host tier (hicache) on")
	}
	if len(prompt) == 0 {
		return 0, errors.New("serve: offload of an empty prompt")
	}
	op := &offloadOp{prompt: slices.Clone(prompt), done: make(chan offloadResult, 1)}
	if err := e.inbox.putOffload(op); err != nil {
		return 0, err
	}
	select {
	case res := <-op.done:
		return res.tokens, res.err
	case <-ctx.Done():
		return 0, fmt.Errorf("serve: offload: %w", ctx.Err())
	case <-e.done:
		return 0, errors.New("serve: engine stopped during an offload")
	}
}

// SetIndexK switches the index-K precision live (see indexk.go): it drains
// the engine, aborting what is still in flight after drain, switches every
// rank and returns how long admission paused. It returns ctx's error if
// ctx ends first (the switch still goes on).
func (e *Engine) SetIndexK(ctx context.Context, dt kernels.IndexKDType, drain time.Duration) (IndexKSwitch, error) {
	from := e.view.IndexK()
	switch {
	case e.m.Config.Indexer == nil:
		return IndexKSwitch{}, errors.New("serve: the model has no sparse indexer: it stores no index keys")
	case dt != kernels.IndexFP8 && dt != kernels.IndexBF16:
		return IndexKSwitch{}, fmt.Errorf("serve: unknown index-K precision %v", dt)
	case drain < 0:
		return IndexKSwitch{}, fmt.Errorf("serve: drain bound %v: want non-negative", drain)
	}
	now := e.now()
	op := &indexKOp{to: dt, since: now, deadline: now.Add(drain), done: make(chan IndexKSwitch, 1)}
	queued, err := e.inbox.putIndexK(op, dt == from)
	switch {
	case err != nil:
		return IndexKSwitch{}, err
	case !queued:
		return IndexKSwitch{From: from, To: dt}, nil
	}
	select {
	case res := <-op.done:
		return res, nil
	case <-ctx.Done():
		return IndexKSwitch{}, fmt.Errorf("serve: index-K switch to %v: %w (it goes on)", dt, ctx.Err())
	case <-e.done:
		return IndexKSwitch{}, errors.New("serve: engine stopped during an index-K switch")
	}
}

// AllowPrefillBootstrap adds a prefill registry to those a decode accepts
// in requests (PDConfig.PrefillBootstrap), for a cluster that learns its
// prefill servers as it runs.
func (e *Engine) AllowPrefillBootstrap(url string) error {
	if e.cfg.Role != pdproto.RoleDecode {
		return errors.New("serve: only a decode server takes prefill registries")
	}
	return e.pd.reg.allow(url)
}
