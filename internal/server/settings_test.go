package server

import (
	"slices"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/kernels"
)

// TestDebugSettings: GET /debug/v1/settings publishes the timeouts a
// decode server was configured with, not the defaults; the defaults of
// what was not set; the fault switches on now, live; the server's own
// thresholds. GET /debug/v1/state carries the same settings, typed.
func TestDebugSettings(t *testing.T) {
	cfg := serve.Config{PageSize: 4, MaxRunning: 4, Role: pdproto.RoleDecode, Heartbeat: 30 * time.Millisecond,
		WaitingTimeout: 9 * time.Second, Faults: []string{"drop-kv-chunk"},
		PD: serve.PDConfig{BootstrapTimeout: 3 * time.Second, TransferTimeout: 7 * time.Second, AbortAckTimeout: 1500 * time.Millisecond,
			HeartbeatInterval: 200 * time.Millisecond, HeartbeatTimeout: 2 * time.Second, ReservedDecodeTokens: 64}}
	e := newEnvWith(t, cfg, Options{StallAfter: 3 * time.Second})

	var s debug.Settings
	getJSON(t, e, debug.SettingsPath, &s)
	want := debug.PDSettings{Host: "127.0.0.1", BootstrapTimeoutMS: 3000, TransferTimeoutMS: 7000, InflightTimeoutMS: 10000,
		AbortAckTimeoutMS: 1500, SendTimeoutMS: 2000, HeartbeatIntervalMS: 200, HeartbeatTimeoutMS: 2000, ReservedDecodeTokens: 64,
		MaxPeerSockets: 256, PeerSocketIdleMS: 60000, ReplyQueue: 1024, EarlyRoomsPerSender: 512, HandshakeTimeoutMS: 5000, MaxConnections: 256, BootstrapCacheSize: 64, AdvertiseHost: "127.0.0.1"}
	if s.PD == nil || *s.PD != want {
		t.Fatalf("pd settings %+v, want %+v", s.PD, want)
	}
	if s.Role != pdproto.RoleDecode || s.TPSize != 1 || s.PageSize != 4 || s.MaxRunning != 4 || !s.PrefixCache ||
		s.HeartbeatMS != 30 || s.WaitingTimeoutMS != 9000 || s.PrefillTimeoutMS != 0 || s.StallAfterMS != 3000 ||
		s.CollectiveWatchdogMS != 5000 || s.IndexK != "fp8" || !s.Indexer || s.KVDType != "f32" || !slices.Equal(s.FaultsOn, []string{"drop-kv-chunk"}) {
		t.Errorf("settings %+v", s)
	}

	if err := e.eng.SetFault(serve.FaultPDLoopExit, true); err != nil {
		t.Fatal(err)
	}
	if err := e.eng.SetFault("drop-kv-chunk", false); err != nil {
		t.Fatal(err)
	}
	getJSON(t, e, debug.SettingsPath, &s)
	if !slices.Equal(s.FaultsOn, []string{serve.FaultPDLoopExit}) {
		t.Errorf("faults on after switching: %q", s.FaultsOn)
	}

	var st debug.StateResponse
	getJSON(t, e, debug.StatePath, &st)
	if st.Model != "tiny" || st.ContextTokens != e.m.Config.ContextLen || st.ContextTokens <= 0 || st.Settings.PD == nil || *st.Settings.PD != want || st.Settings.MaxRunning != 4 || st.Snapshot == nil ||
		st.Snapshot.Counts == nil || st.Snapshot.Requests == nil {
		t.Errorf("state %+v", st)
	}

	// A colocated server has no PD settings; nothing on, an empty list.
	// Its pools store bf16, and say so.
	col := newEnvWith(t, serve.Config{PageSize: 4, MaxRunning: 4, KVType: kernels.BF16}, Options{})
	var cs debug.Settings
	getJSON(t, col, debug.SettingsPath, &cs)
	if cs.KVDType != "bf16" {
		t.Errorf("kv_dtype %q, want bf16", cs.KVDType)
	}
	if cs.PD != nil || cs.Role != pdproto.RoleColocated || cs.FaultsOn == nil || len(cs.FaultsOn) != 0 || cs.StallAfterMS != 5000 {
		t.Errorf("colocated settings %+v", cs)
	}
}
