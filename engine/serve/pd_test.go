package serve

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// pdPair is a prefill and a decode engine in one process, on real ZeroMQ
// sockets, with the prefill's registry on a real HTTP server.
type pdPair struct {
	prefill, decode *Engine
	url             string
}

func newPDPair(t *testing.T, cfg Config) *pdPair {
	t.Helper()
	m := tinyModel(t)
	pc, dc := cfg, cfg
	pc.Role, dc.Role = pdproto.RolePrefill, pdproto.RoleDecode
	p := newEngine(t, m, pc)
	d := newEngine(t, m, dc)
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: cfg.TP})
	for _, info := range p.RankInfos() {
		if _, err := reg.Register(info); err != nil {
			t.Fatal(err)
		}
	}
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	return &pdPair{prefill: p, decode: d, url: ts.URL}
}

var nextRoom uint64 = 1000

// run sends one request to both sides under a fresh room, as a router does,
// and returns the decode's tokens and finish and the prefill's finish.
func (pp *pdPair) run(t *testing.T, ctx context.Context, q Request, room uint64) ([]int32, Finish, Finish) {
	t.Helper()
	pq, dq := q, q
	pq.PD = &PDRequest{Room: room}
	dq.PD = &PDRequest{Room: room, BootstrapURL: pp.url}
	ps, err := pp.prefill.Submit(ctx, pq)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := pp.decode.Submit(ctx, dq)
	if err != nil {
		t.Fatal(err)
	}
	toks, dfin := collect(t, ds, 30*time.Second)
	_, pfin := collect(t, ps, 30*time.Second)
	return toks, dfin, pfin
}

// PD greedy output equals the colocated engine's, at TP 1 and 2, with both
// index-K precisions, prompts served concurrently in chunks.
func TestPDMatchesColocated(t *testing.T) {
	m := tinyModel(t)
	ps := testmodel.Prompts(17, 12, 3, 40, m.Config.VocabSize)
	const maxTok = 10
	for _, ik := range []kernels.IndexKDType{kernels.IndexFP8, kernels.IndexBF16} {
		for _, n := range []int{1, 2} {
			t.Run(fmt.Sprintf("tp%d-%v", n, ik), func(t *testing.T) {
				cfg := Config{TP: n, PageSize: 4, KVTokens: 512, MaxRunning: 4, MaxBatchTokens: 32, PrefillChunk: 7, IndexK: ik}
				col := newEngine(t, m, cfg)
				want := make([][]int32, len(ps))
				for i, p := range ps {
					s, err := col.Submit(context.Background(), Request{Prompt: p, MaxTokens: maxTok})
					if err != nil {
						t.Fatal(err)
					}
					want[i], _ = collect(t, s, 30*time.Second)
				}
				pp := newPDPair(t, cfg)
				var wg sync.WaitGroup
				for i, p := range ps {
					wg.Go(func() {
						toks, dfin, pfin := pp.run(t, context.Background(), Request{Prompt: p, MaxTokens: maxTok}, uint64(5000+i))
						if !slices.Equal(toks, want[i]) {
							t.Errorf("prompt %d: PD %v (%s), colocated %v", i, toks, dfin.Reason, want[i])
						}
						if pfin.Reason != ReasonLength || dfin.CompletionTokens != len(toks) {
							t.Errorf("prompt %d: prefill %+v, decode %+v", i, pfin, dfin)
						}
					})
				}
				wg.Wait()
				for _, e := range []*Engine{pp.prefill, pp.decode} {
					checkPools(t, e)
					for q, v := range e.PDQueues() {
						if v != 0 {
							t.Errorf("%s queue %s holds %d", e.cfg.Role, q, v)
						}
					}
				}
				if pp.decode.PDTransferBytes() == 0 || pp.prefill.PDTransferBytes() != pp.decode.PDTransferBytes() {
					t.Errorf("transfer bytes: prefill %d, decode %d", pp.prefill.PDTransferBytes(), pp.decode.PDTransferBytes())
				}
			})
		}
	}
}
