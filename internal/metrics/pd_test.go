package metrics

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// finish reads s to its finish.
func finish(t *testing.T, s *serve.Stream) serve.Finish {
	t.Helper()
	timer := time.NewTimer(30 * time.Second)
	defer timer.Stop()
	for {
		select {
		case ev, ok := <-s.Events:
			if !ok {
				t.Fatalf("stream %d closed without a finish", s.ID)
			}
			if ev.Finish != nil {
				return *ev.Finish
			}
		case <-timer.C:
			t.Fatalf("stream %d: no finish within 30s", s.ID)
		}
	}
}

// A prefill and a decode engine, on real sockets with the prefill's
// registry on a real HTTP server, export their PD families after one
// request: bytes moved on both sides, queues empty, receive loops up.
func TestPDEngines(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	const tp = 2
	engines := map[string]*serve.Engine{}
	regs := map[string]*Metrics{}
	for _, role := range []string{pdproto.RolePrefill, pdproto.RoleDecode} {
		met := New(nil)
		eng, err := serve.New(m, withCPU(serve.Config{Role: role, TP: tp, PageSize: 4, KVTokens: 256, MaxRunning: 4, Observer: met}))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { eng.Close() })
		if err := met.Watch(eng); err != nil {
			t.Fatal(err)
		}
		engines[role], regs[role] = eng, met
	}
	reg := bootstrap.NewRegistry(bootstrap.Options{TPSize: tp})
	for _, info := range engines[pdproto.RolePrefill].PD().RankInfos() {
		if _, err := reg.Register(info); err != nil {
			t.Fatal(err)
		}
	}
	mux := http.NewServeMux()
	mux.Handle(pdproto.BootstrapPrefix, reg)
	ts := httptest.NewServer(mux)
	defer ts.Close()

	ctx := context.Background()
	q := serve.Request{Prompt: []int32{5, 6, 7, 8, 9, 10, 11}, MaxTokens: 4, IgnoreEOS: true}
	pq, dq := q, q
	pq.PD = &serve.PDRequest{Room: 77}
	dq.PD = &serve.PDRequest{Room: 77, BootstrapURL: ts.URL}
	if err := engines[pdproto.RoleDecode].AllowPrefillBootstrap(ts.URL); err != nil {
		t.Fatal(err)
	}
	ps, err := engines[pdproto.RolePrefill].Submit(ctx, pq)
	if err != nil {
		t.Fatal(err)
	}
	// Refused at the door, and counted: a second request for the live
	// room, a decode request for a registry not listed.
	if _, err := engines[pdproto.RolePrefill].Submit(ctx, pq); !errors.Is(err, serve.ErrRoomInUse) {
		t.Fatalf("a duplicate room: %v", err)
	}
	stray := dq
	stray.PD = &serve.PDRequest{Room: 78, BootstrapURL: "http://169.254.169.254"}
	if _, err := engines[pdproto.RoleDecode].Submit(ctx, stray); !errors.Is(err, serve.ErrBootstrapURL) {
		t.Fatalf("an unlisted registry: %v", err)
	}
	ds, err := engines[pdproto.RoleDecode].Submit(ctx, dq)
	if err != nil {
		t.Fatal(err)
	}
	if f := finish(t, ds); f.Reason != serve.ReasonLength {
		t.Fatalf("decode finished %+v", f)
	}
	if f := finish(t, ps); f.Reason != serve.ReasonLength {
		t.Fatalf("prefill finished %+v", f)
	}

	queues := map[string][]string{
		pdproto.RolePrefill: {"pdkit_num_prefill_bootstrap_queue_reqs", "pdkit_num_prefill_inflight_queue_reqs"},
		pdproto.RoleDecode:  {"pdkit_num_decode_prealloc_queue_reqs", "pdkit_num_decode_transfer_queue_reqs", "pdkit_num_decode_aborting_queue_reqs"},
	}
	for role, met := range regs {
		// Every rank publishes its queues after its iteration: wait
		// until all have caught up with the finish; past the bound the
		// checks below say what is left.
		var v map[string]float64
		waitfor.Poll(10*time.Second, func() bool {
			v = values(t, met.Registry())
			empty := true
			for _, name := range queues[role] {
				for r := range tp {
					empty = empty && v[name+"/"+strconv.Itoa(r)] == 0
				}
			}
			return empty
		})
		for r := range tp {
			rank := "/" + strconv.Itoa(r)
			for _, name := range queues[role] {
				if got, ok := v[name+rank]; !ok || got != 0 {
					t.Errorf("%s: %s%s = %v (present %v), want 0", role, name, rank, got, ok)
				}
			}
			if got := v["pdkit_pd_receive_loop_up"+rank]; got != 1 {
				t.Errorf("%s: receive loop up%s = %v", role, rank, got)
			}
			if got := v["pdkit_pd_messages_received_total"+rank]; got < 1 {
				t.Errorf("%s: messages received%s = %v", role, rank, got)
			}
			if got := v["pdkit_pd_messages_sent_total"+rank]; got < 1 {
				t.Errorf("%s: messages sent%s = %v", role, rank, got)
			}
			for _, k := range []string{"pdkit_pd_send_errors_total" + rank,
				"pdkit_pd_dropped_messages_total" + rank + "/" + DropMalformed, "pdkit_pd_dropped_messages_total" + rank + "/" + DropHandlerPanic,
				"pdkit_pd_dropped_messages_total" + rank + "/" + DropLate, "pdkit_pd_dropped_messages_total" + rank + "/" + DropMisplaced,
				"pdkit_pd_dropped_messages_total" + rank + "/" + DropOverQuota, "pdkit_pd_dropped_messages_total" + rank + "/" + DropReply,
				"pdkit_pd_peer_sockets_closed_total" + rank + "/" + PeerClosedEvicted, "pdkit_pd_peer_sockets_closed_total" + rank + "/" + PeerClosedIdle} {
				if got, ok := v[k]; !ok || got != 0 {
					t.Errorf("%s: %s = %v (present %v), want 0", role, k, got, ok)
				}
			}
		}
		refused := map[string]float64{pdproto.RolePrefill + "/" + RefusedRoomInUse: 1, pdproto.RoleDecode + "/" + RefusedBootstrapURL: 1}
		for _, reason := range []string{RefusedRoomInUse, RefusedBootstrapURL} {
			if got, ok := v["pdkit_pd_refused_reqs_total/"+reason]; !ok || got != refused[role+"/"+reason] {
				t.Errorf("%s: refused %s = %v (present %v), want %v", role, reason, got, ok, refused[role+"/"+reason])
			}
		}
		if got, ok := v["pdkit_pd_bootstrap_lookups_evicted_total"]; !ok || got != 0 {
			t.Errorf("%s: lookups evicted %v (present %v)", role, got, ok)
		}
		if got := v["pdkit_kv_transfer_bytes_total"]; got <= 0 {
			t.Errorf("%s: kv transfer bytes %v", role, got)
		}
		fq := map[string]string{pdproto.RolePrefill: "bootstrap", pdproto.RoleDecode: "transfer"}[role]
		if got, ok := v["pdkit_pd_failed_reqs_total/"+fq]; !ok || got != 0 {
			t.Errorf("%s: failed reqs in %s %v (present %v)", role, fq, got, ok)
		}
		for r := range tp {
			if got := v["pdkit_kv_transfer_rank_bytes_total/"+strconv.Itoa(r)]; got <= 0 {
				t.Errorf("%s: rank %d transfer bytes %v", role, r, got)
			}
		}
		// promtool check metrics would find nothing to say.
		lint(t, met)
		// The other role's queues are not exported.
		for other, names := range queues {
			if other == role {
				continue
			}
			for _, name := range names {
				if _, ok := v[name+"/0"]; ok {
					t.Errorf("%s exports %s", role, name)
				}
			}
		}
	}
}

// A colocated engine exports no PD family.
func TestColocatedHasNoPD(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	met := watched(t, m, serve.Config{PageSize: 4})
	for k := range values(t, met.Registry()) {
		if strings.HasPrefix(k, "pdkit_pd_") || strings.Contains(k, "_queue_reqs") || k == "pdkit_kv_transfer_bytes_total" {
			t.Errorf("colocated engine exports %s", k)
		}
	}
}
