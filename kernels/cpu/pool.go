package cpu

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// pool is the Backend's set of worker goroutines. A call cuts its work into
// parts that write disjoint outputs; the calling goroutine and the workers
// claim parts from a shared counter until none is left, and the call returns
// when every part is done. Which goroutine runs a part never changes what
// the part computes.
//
// A decode step makes dozens of calls of a few microseconds each, so waking
// a parked goroutine (several microseconds) would eat the gain. A worker
// that finishes a job therefore watches for the next one for a short while
// (spinFor) before parking on the jobs channel, and the caller likewise
// watches for its helpers to finish before parking. Between steps the
// workers park and cost nothing.
//
// The workers are owned by the pool: they start in newPool and exit when
// close is called (Backend.Close), after finishing the job in hand.
type pool struct {
	threads int
	cur     atomic.Pointer[job] // the latest job, for spinning workers
	seq     atomic.Uint64       // numbers jobs
	parked  atomic.Int32        // workers blocked on jobs
	jobs    chan *job           // wakes parked workers

	mu      sync.RWMutex // guards closed against sends on a closed jobs
	closed  bool
	quit    atomic.Bool
	workers sync.WaitGroup
}

// spinFor is how long an idle worker, or a caller waiting for its helpers,
// polls before parking.
const spinFor = 50 * time.Microsecond

type job struct {
	fn       func(part int)
	seq      uint64
	parts    int32
	next     atomic.Int32  // next part to claim
	done     atomic.Int32  // parts finished
	finished chan struct{} // closed when done reaches parts
	perr     atomic.Pointer[string]
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
	var last uint64 // the last job worked on, by number: holding the job
	// itself would keep its closure (and so the Backend) reachable.
	for {
		j := p.spinForJob(last)
		if j == nil {
			p.parked.Add(1)
			var ok bool
			j, ok = <-p.jobs
			p.parked.Add(-1)
			if !ok {
				return
			}
		}
		last = j.seq
		j.work()
	}
}

// spinForJob polls for a job other than last for up to spinFor.
func (p *pool) spinForJob(last uint64) *job {
	start := time.Now()
	for i := 0; ; i++ {
		if p.quit.Load() {
			return nil
		}
		if j := p.cur.Load(); j != nil && j.seq != last && j.next.Load() < j.parts {
			return j
		}
		if i%64 == 63 {
			if time.Since(start) > spinFor {
				return nil
			}
			runtime.Gosched()
		}
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
	j := &job{fn: fn, seq: p.seq.Add(1), parts: int32(parts), finished: make(chan struct{})}
	p.cur.Store(j)
	// Wake parked workers; spinning ones see cur.
	if n := min(int(p.parked.Load()), parts-1); n > 0 {
		p.mu.RLock()
		if !p.closed {
			for range n {
				select {
				case p.jobs <- j:
				default:
				}
			}
		}
		p.mu.RUnlock()
	}
	j.work()
	start := time.Now()
	for i := 0; j.done.Load() < j.parts; i++ {
		if i%64 == 63 && time.Since(start) > spinFor {
			<-j.finished
			break
		}
	}
	p.cur.CompareAndSwap(j, nil)
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
	defer func() {
		if r := recover(); r != nil {
			msg := fmt.Sprintf("kernels/cpu: part %d: %v", i, r)
			j.perr.CompareAndSwap(nil, &msg)
		}
		if j.done.Add(1) == j.parts {
			close(j.finished)
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
		p.quit.Store(true)
		close(p.jobs)
	}
	p.mu.Unlock()
	p.workers.Wait()
}
