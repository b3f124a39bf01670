package cpu

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// pool is the Backend's set of worker goroutines. A call cuts its work into
// parts that write disjoint outputs; the calling goroutine and up to
// threads-1 workers claim parts from a shared counter until none is left,
// and the call returns when every part is done. Which goroutine runs a part
// never changes what the part computes.
//
// The workers are owned by the pool: they start in newPool and exit when
// close is called (Backend.Close), after finishing any job already handed
// to them.
type pool struct {
	threads int
	jobs    chan *job

	mu      sync.RWMutex // guards closed against sends on a closed jobs
	closed  bool
	workers sync.WaitGroup
}

type job struct {
	fn    func(part int)
	parts int32
	next  atomic.Int32
	wg    sync.WaitGroup
	perr  atomic.Pointer[string] // first panic, re-raised by the caller
}

func newPool(threads int) *pool {
	p := &pool{threads: threads, jobs: make(chan *job, threads)}
	p.workers.Add(threads - 1)
	for range threads - 1 {
		go p.worker()
	}
	return p
}

func (p *pool) worker() {
	defer p.workers.Done()
	for j := range p.jobs {
		j.work()
	}
}

// run calls fn(i) for every i < parts, spread over the pool, and returns
// when all are done. A panic in a part is re-raised here.
func (p *pool) run(parts int, fn func(part int)) {
	if parts <= 0 {
		return
	}
	if parts == 1 || p.threads == 1 {
		for i := range parts {
			fn(i)
		}
		return
	}
	j := &job{fn: fn, parts: int32(parts)}
	j.wg.Add(parts)
	p.mu.RLock()
	if !p.closed {
		for range min(parts, p.threads) - 1 {
			select {
			case p.jobs <- j:
			default: // every worker already has a job queued: do more here
			}
		}
	}
	p.mu.RUnlock()
	j.work()
	j.wg.Wait()
	if e := j.perr.Load(); e != nil {
		panic(*e)
	}
}

// work claims and runs parts until none is left.
func (j *job) work() {
	for {
		i := j.next.Add(1) - 1
		if i >= j.parts {
			return
		}
		j.runPart(int(i))
	}
}

func (j *job) runPart(i int) {
	defer j.wg.Done()
	defer func() {
		if r := recover(); r != nil {
			msg := fmt.Sprintf("kernels/cpu: part %d: %v", i, r)
			j.perr.CompareAndSwap(nil, &msg)
		}
	}()
	j.fn(i)
}

// close stops the workers and waits for them to exit; later runs use only
// the calling goroutine. It is idempotent.
func (p *pool) close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.jobs)
	}
	p.mu.Unlock()
	p.workers.Wait()
}
