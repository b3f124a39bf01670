package serve

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/kernels"
)

// notSettings are the Config fields GET /debug/v1/settings does not
// publish, and why.
var notSettings = map[string]string{
	"Backend":  "a function: the caller's kernels",
	"OnStall":  "a function: where the watchdog reports",
	"Logger":   "where the engine logs",
	"Observer": "a function: the metrics",
	"Clock":    "the engine's time source: real, or a test's",
	"Faults":   "the switches on at start; Settings publishes those on now (FaultsOn)",
	"PD":       "published field by field, as Settings.PD",

	"PD.OnRankInfos": "a function: where a prefill re-registers its ranks",
	"HiCache":        "published field by field, as Settings.HiCache",

	"HiCache.Available": "the host memory the tier may take, read from the machine by default: a bound, not a setting",
}

// published maps each Config and PDConfig field to the Settings JSON
// field it is published as.
var published = map[string]string{
	"TP": "tp_size", "PageSize": "page_size", "KVTokens": "kv_tokens", "KVMemory": "kv_memory_bytes", "MaxRunning": "max_running",
	"MaxBatchTokens": "max_batch_tokens", "PrefillChunk": "prefill_chunk", "IndexK": "index_k", "KVType": "kv_dtype",
	"DisablePrefixCache": "prefix_cache", "Schedule": "schedule", "Name": "name", "Role": "role",
	"FlightRecorderLen": "flight_recorder_len", "DecisionLogLen": "decision_log_len", "CollectiveWatchdog": "collective_watchdog_ms", "CollectiveTimeout": "collective_timeout_ms",
	"CloseTimeout": "close_timeout_ms", "WaitingTimeout": "waiting_timeout_ms", "PrefillTimeout": "prefill_timeout_ms",
	"RequestTimeout": "request_timeout_ms", "Heartbeat": "heartbeat_ms",

	"PD.Host": "pd.host", "PD.BootstrapTimeout": "pd.bootstrap_timeout_ms", "PD.TransferTimeout": "pd.transfer_timeout_ms",
	"PD.InflightTimeout": "pd.inflight_timeout_ms", "PD.AbortAckTimeout": "pd.abort_ack_timeout_ms",
	"PD.SendTimeout": "pd.send_timeout_ms", "PD.HeartbeatInterval": "pd.heartbeat_interval_ms",
	"PD.HeartbeatTimeout": "pd.heartbeat_timeout_ms", "PD.ReservedDecodeTokens": "pd.reserved_decode_tokens",
	"PD.MaxMessageBytes": "pd.max_message_bytes", "PD.MaxPeerSockets": "pd.max_peer_sockets",
	"PD.PeerSocketIdle": "pd.peer_socket_idle_ms", "PD.ReplyQueue": "pd.reply_queue",
	"PD.EarlyRoomsPerSender": "pd.early_rooms_per_sender", "PD.PrefillBootstrap": "pd.prefill_bootstrap",
	"PD.AdvertiseHost": "pd.advertise_host", "PD.HandshakeTimeout": "pd.handshake_timeout_ms", "PD.MaxConnections": "pd.max_connections", "PD.Secret": "pd.authenticated",
	"PD.BootstrapCacheSize": "pd.bootstrap_cache_size",

	"HiCache.Enabled": "hicache.enabled_at_start", "HiCache.Bytes": "hicache.size_bytes", "HiCache.Ratio": "hicache.ratio",
	"HiCache.Policy": "hicache.write_policy", "HiCache.LoadBandwidth": "hicache.load_bandwidth_bytes_per_second",
}

// TestSettingsCoverConfig: every field of Config, PDConfig and
// HiCacheConfig is published in Settings, or listed in notSettings with the reason; so a setting added
// to the engine is published, or the addition says why not.
func TestSettingsCoverConfig(t *testing.T) {
	var fields []string
	for f := range reflect.TypeFor[Config]().Fields() {
		fields = append(fields, f.Name)
	}
	for f := range reflect.TypeFor[PDConfig]().Fields() {
		fields = append(fields, "PD."+f.Name)
	}
	for f := range reflect.TypeFor[HiCacheConfig]().Fields() {
		fields = append(fields, "HiCache."+f.Name)
	}
	for _, f := range fields {
		_, pub := published[f]
		_, not := notSettings[f]
		if pub == not {
			t.Errorf("Config field %s: publish it in settingsOf (settings.go) and list it in published, or list it in notSettings with the reason", f)
		}
	}
	for f := range published {
		if !slices.Contains(fields, f) {
			t.Errorf("published lists %s, which Config does not have", f)
		}
	}

	// Every published JSON field exists in Settings.
	b, err := json.Marshal(settingsOf(DefaultConfig(), false, nil))
	if err != nil {
		t.Fatal(err)
	}
	var top, hc map[string]json.RawMessage
	json.Unmarshal(b, &top)
	json.Unmarshal(top["hicache"], &hc)
	s := settingsOf(Config{Role: pdproto.RolePrefill}, false, nil)
	b, _ = json.Marshal(s.PD)
	var pd map[string]json.RawMessage
	json.Unmarshal(b, &pd)
	for f, key := range published {
		m, k := top, key
		if rest, ok := strings.CutPrefix(key, "pd."); ok {
			m, k = pd, rest
		}
		if rest, ok := strings.CutPrefix(key, "hicache."); ok {
			m, k = hc, rest
		}
		if _, ok := m[k]; !ok {
			t.Errorf("%s is published as %s, which Settings does not have", f, key)
		}
	}
}

// TestSettingsOf: non-default values are published as the engine runs
// with them, the defaults filled in, durations in milliseconds; a
// colocated engine has no PD settings.
func TestSettingsOf(t *testing.T) {
	cfg := Config{
		TP: 2, PageSize: 4, KVTokens: 128, MaxRunning: 4, MaxBatchTokens: 64, PrefillChunk: 32, IndexK: kernels.IndexBF16,
		DisablePrefixCache: true, Name: "p0", Role: pdproto.RoleDecode, CollectiveWatchdog: -1,
		WaitingTimeout: 3 * time.Second, Heartbeat: 20 * time.Millisecond,
		PD: PDConfig{TransferTimeout: 7 * time.Second, AbortAckTimeout: 1500 * time.Millisecond, HeartbeatTimeout: 4 * time.Second,
			ReservedDecodeTokens: -1, ReplyQueue: 64},
	}
	cfg.setDefaults(nil)
	got := settingsOf(cfg, true, []string{FaultStallLastRank})
	want := debug.Settings{
		Role: "decode", Name: "p0", TPSize: 2, PageSize: 4, KVTokens: 128, KVPages: 32, MaxRunning: 4, MaxBatchTokens: 64,
		PrefillChunk: 32, PrefixCache: false, Schedule: "lockstep", KVDType: "f32", IndexK: "bf16", Indexer: true, HeartbeatMS: 20, CollectiveWatchdogMS: 0,
		FlightRecorderLen: 256, DecisionLogLen: DefaultDecisionLogLen, CloseTimeoutMS: 5000, WaitingTimeoutMS: 3000, RequestTimeoutMS: 600000,
		PD: &debug.PDSettings{Host: "127.0.0.1", BootstrapTimeoutMS: 10000, TransferTimeoutMS: 7000, InflightTimeoutMS: 10000,
			AbortAckTimeoutMS: 1500, SendTimeoutMS: 2000, HeartbeatIntervalMS: 500, HeartbeatTimeoutMS: 4000, ReservedDecodeTokens: -1,
			MaxPeerSockets: 256, PeerSocketIdleMS: 60000, ReplyQueue: 64, EarlyRoomsPerSender: 512, HandshakeTimeoutMS: 5000, MaxConnections: 256, BootstrapCacheSize: 64, AdvertiseHost: "127.0.0.1"},
		FaultsOn: []string{FaultStallLastRank},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("settings\n%+v\n%+v\nwant\n%+v\n%+v", got, *got.PD, want, *want.PD)
	}

	col := settingsOf(DefaultConfig(), false, nil)
	if col.PD != nil || col.Role != pdproto.RoleColocated || col.CollectiveWatchdogMS != 5000 || col.FaultsOn == nil || !col.PrefixCache {
		t.Errorf("colocated defaults: %+v", col)
	}
	// The host tier: its defaults (off, twice the device pool,
	// write-through, unlimited), then as configured; none without a prefix
	// cache (above).
	if h := col.HiCache; h == nil || *h != (debug.HiCacheSettings{Ratio: 2, WritePolicy: "write-through"}) {
		t.Errorf("hicache defaults: %+v", h)
	}
	hc := DefaultConfig()
	hc.HiCache = HiCacheConfig{Enabled: true, Bytes: 64 << 20, Ratio: 3, Policy: prefix.WriteBack, LoadBandwidth: 2e9}
	wantHC := debug.HiCacheSettings{EnabledAtStart: true, SizeBytes: 64 << 20, Ratio: 3, WritePolicy: "write-back", LoadBandwidthBytesPerSecond: 2e9}
	if h := settingsOf(hc, false, nil).HiCache; h == nil || *h != wantHC {
		t.Errorf("hicache settings %+v, want %+v", h, wantHC)
	}
}

// TestSettingsHideTheSecret: the settings say a PD server runs with a
// cluster secret, and never publish it.
func TestSettingsHideTheSecret(t *testing.T) {
	secret, text := clusterauth.Generate()
	cfg := DefaultConfig()
	cfg.Role = pdproto.RolePrefill
	cfg.PD.Secret = secret
	s := settingsOf(cfg, false, nil)
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	token := secret.AdminToken()
	if !s.PD.Authenticated || strings.Contains(string(b), text) || strings.Contains(string(b), token) {
		t.Fatalf("settings: %s", b)
	}
}
