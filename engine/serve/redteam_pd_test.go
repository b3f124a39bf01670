package serve

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/kvcache"
	"github.com/pdkit/pdkit/engine/pd/zmqlink"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// A forger on the decode's KV socket sends a room the whole, well-formed
// KV of another prompt of the same length (real KV, captured from a real
// transfer), under that prompt's fingerprint. The decode applies none of
// it: the room fails naming the mismatch, it streams no token, and its
// pages come back.
func TestRedTeamForgedFingerprint(t *testing.T) {
	const captured = 9001
	stolen := []int32{5, 6, 7, 8, 9, 10, 11, 12}
	victim := []int32{15, 16, 17, 18, 19, 20, 21, 22}
	kv := make(chan []pdproto.LayerKV, 1)
	arrivedHook = func(rank int, room uint64, pool *kvcache.Pool, slots []int32) {
		if rank != 0 || room != captured {
			return
		}
		slots = slots[:len(stolen)]
		var layers []pdproto.LayerKV
		for layer := range pool.Config().Layers {
			var l pdproto.LayerKV
			l.K, l.V = pool.AppendKV(layer, slots, nil, nil)
			l.IndexK, l.IndexKScales = pool.AppendIndexK(layer, slots, nil, nil)
			layers = append(layers, l)
		}
		kv <- layers
	}
	t.Cleanup(func() { arrivedHook = nil })
	pp := newPDPair(t, Config{PageSize: 4, KVTokens: 512, MaxRunning: 4})
	ctx := context.Background()
	toks, fin, _ := pp.run(t, ctx, Request{Prompt: stolen, MaxTokens: 4, IgnoreEOS: true}, captured)
	if fin.Reason != ReasonLength {
		t.Fatalf("the request whose KV is stolen: %+v", fin)
	}
	layers := <-kv

	// The victim's decode half waits for its KV; its prefill half never
	// comes.
	const room = 9002
	d := submitHalf(t, pp.decode, Request{Prompt: victim, MaxTokens: 4, IgnoreEOS: true}, room, pp.url)
	waitfor.Check(t, "the victim in transfer", 10*time.Second, func() bool { return inQueue(pp.decode, d.s.ID, "transfer") })

	out, err := zmqlink.NewOutbox(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	frames, err := pdproto.Encode(&pdproto.KVChunk{Room: room, End: uint32(len(stolen)), Prompt: pdproto.PromptFingerprint(stolen),
		Layers: layers, Final: &pdproto.ChunkFinal{FirstToken: toks[0], PromptTokens: uint32(len(stolen))}})
	if err != nil {
		t.Fatal(err)
	}
	if err := out.Send(ctx, pp.decode.PD().Links()[0].Inbox.Endpoint, frames); err != nil {
		t.Fatal(err)
	}
	got, fin := collect(t, d.s, 20*time.Second)
	if len(got) != 0 || !strings.Contains(fin.Reason, "another prompt") {
		t.Fatalf("the victim got %d tokens %v, finish %q; want none and the mismatch named", len(got), got, fin.Reason)
	}
	if n := pp.decode.PD().FailuresByReason()["prompt-mismatch"]; n != 1 {
		t.Errorf("%d prompt-mismatch failures counted, want 1", n)
	}
	waitfor.Check(t, "the decode's queues empty", 10*time.Second, func() bool {
		q := pp.decode.PD().Queues()
		return q["transfer"]+q["aborting"]+q["prealloc"] == 0
	})
	checkPools(t, pp.decode)
}

// The decode's registry lookups are an LRU of a bounded size: a lookup
// past it drops the least recently used and counts it; one used since
// stays.
func TestBootstrapLookupCacheBounded(t *testing.T) {
	r, err := newRegistries(PDConfig{BootstrapCacheSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, u := range []string{"http://a:1", "http://b:1"} {
		r.put(u, &resolution{url: u})
	}
	r.get("http://a:1") // b is now the least recently used
	r.put("http://c:1", &resolution{url: "http://c:1"})
	if r.get("http://b:1") != nil || r.get("http://a:1") == nil || r.get("http://c:1") == nil {
		t.Errorf("after c: a %v, b %v, c %v; want b dropped", r.get("http://a:1") != nil, r.get("http://b:1") != nil, r.get("http://c:1") != nil)
	}
	for i := range 1000 {
		u := "http://x:" + strconv.Itoa(i)
		r.put(u, &resolution{url: u})
	}
	if n := r.lru.Len(); n != 2 || len(r.byURL) != 2 {
		t.Errorf("%d cached (%d indexed), want 2", n, len(r.byURL))
	}
	if n := r.evicted.Load(); n != 1+1000 {
		t.Errorf("%d evictions counted, want %d", n, 1001)
	}
}

// A registry URL is compared in one form (scheme and host case, a
// trailing slash), and what no registry URL has is refused.
func TestCanonicalRegistry(t *testing.T) {
	r, err := newRegistries(PDConfig{BootstrapCacheSize: 1, PrefillBootstrap: []string{"http://Prefill-0:8998/"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{"http://prefill-0:8998", "HTTP://PREFILL-0:8998/", " http://prefill-0:8998 "} {
		if got, err := r.admit(u); err != nil || got != "http://prefill-0:8998" {
			t.Errorf("admit(%q) = %q, %v", u, got, err)
		}
	}
	for _, u := range []string{"http://prefill-0:8999", "https://prefill-0:8998", "http://u@prefill-0:8998", "http://prefill-0:8998/x",
		"http://prefill-0:8998?a=b", "http://prefill-0:8998#f", "ftp://prefill-0:8998", "//prefill-0:8998", ""} {
		if _, err := r.admit(u); err != ErrBootstrapURL {
			t.Errorf("admit(%q): %v, want ErrBootstrapURL", u, err)
		}
	}
	if _, err := newRegistries(PDConfig{PrefillBootstrap: []string{"prefill-0:8998"}}); err == nil {
		t.Error("a prefill registry without a scheme was taken")
	}
}

// A decode room outlives its request's stream while the room's pages wait
// for the prefill's ABORT_ACK: a new request for the room is refused until
// the room is gone (two requests would share its mail), then taken.
func TestRoomHeldWhileAborting(t *testing.T) {
	pp := newPDPair(t, Config{PageSize: 4, KVTokens: 512, MaxRunning: 4, PD: PDConfig{AbortAckTimeout: 2 * time.Second}})
	if err := pp.prefill.SetFault(FaultBootstrapAbortCrash, true); err != nil { // no ABORT_ACK ever comes
		t.Fatal(err)
	}
	const room = 9100
	q := Request{Prompt: []int32{5, 6, 7, 8, 9}, MaxTokens: 4}
	d := submitHalf(t, pp.decode, q, room, pp.url)
	waitfor.Check(t, "in transfer", 10*time.Second, func() bool { return inQueue(pp.decode, d.s.ID, "transfer") })
	d.cancel()
	collect(t, d.s, 10*time.Second) // ended; its pages wait for the ack until the deadline
	q.PD = &PDRequest{Room: room, BootstrapURL: pp.url}
	if _, err := pp.decode.Submit(context.Background(), q); !errors.Is(err, ErrRoomInUse) {
		t.Fatalf("a request for the aborting room: %v, want ErrRoomInUse", err)
	}
	waitfor.Check(t, "the aborting room gone", 10*time.Second, func() bool {
		_, held := pp.decode.PD().RoomRequest(room)
		return pp.decode.PD().Queues()["aborting"] == 0 && !held
	})
	s, err := pp.decode.Submit(context.Background(), q)
	if err != nil {
		t.Fatalf("the room once its abort ended: %v", err)
	}
	s.Abort()
	collect(t, s, 10*time.Second)
}

// A rebuild of the rank group forgets every room the old machines held,
// those whose streams had ended included (an aborted decode room waiting
// for its ack): their rooms are free again, not taken for ever.
func TestRebuildFreesHeldRooms(t *testing.T) {
	cfg := Config{TP: 2, PageSize: 4, KVTokens: 512, MaxRunning: 4,
		PD: PDConfig{AbortAckTimeout: time.Minute, HeartbeatTimeout: time.Minute}}
	pc, dc := cfg, cfg
	dc.Heartbeat, dc.CollectiveWatchdog, dc.CollectiveTimeout = 10*time.Millisecond, 50*time.Millisecond, 500*time.Millisecond
	pp := newPDPairCfg(t, pc, dc)
	if err := pp.prefill.SetFault(FaultBootstrapAbortCrash, true); err != nil { // no ABORT_ACK ever comes
		t.Fatal(err)
	}
	const room = 9200
	q := Request{Prompt: []int32{5, 6, 7, 8, 9}, MaxTokens: 4}
	d := submitHalf(t, pp.decode, q, room, pp.url)
	waitfor.Check(t, "in transfer", 10*time.Second, func() bool { return inQueue(pp.decode, d.s.ID, "transfer") })
	d.cancel()
	collect(t, d.s, 10*time.Second)
	q.PD = &PDRequest{Room: room, BootstrapURL: pp.url}
	if _, err := pp.decode.Submit(context.Background(), q); !errors.Is(err, ErrRoomInUse) {
		t.Fatalf("a request for the aborting room: %v, want ErrRoomInUse", err)
	}

	if err := pp.decode.SetFault(FaultStallLastRank, true); err != nil {
		t.Fatal(err)
	}
	waitfor.Check(t, "the decode rebuilt", 10*time.Second, func() bool { return pp.decode.View().Restarts() >= 1 })
	if err := pp.decode.SetFault(FaultStallLastRank, false); err != nil {
		t.Fatal(err)
	}
	s, err := pp.decode.Submit(context.Background(), q)
	if err != nil {
		t.Fatalf("the room after the rebuild: %v", err)
	}
	s.Abort()
	collect(t, s, 10*time.Second)
}
