package serve

import (
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/pdproto"
)

// Validate is the one check of an engine's settings: each rule refuses
// once, in one wording that names the flag; the PD machine's settings are
// refused in the machine's words, and only for the roles that build one.
func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		role string
		edit func(*Config)
		want string // "" accepts
	}{
		{"colocated", pdproto.RoleColocated, func(*Config) {}, ""},
		{"prefill", pdproto.RolePrefill, func(*Config) {}, ""},
		{"decode", pdproto.RoleDecode, func(*Config) {}, ""},

		// The collective timeout: past the watchdog and the heartbeat.
		{"recovery past the watchdog", pdproto.RoleColocated, func(c *Config) { c.CollectiveTimeout = c.CollectiveWatchdog + 1 }, ""},
		{"recovery at the watchdog", pdproto.RoleColocated, func(c *Config) { c.CollectiveTimeout = c.CollectiveWatchdog },
			"collective timeout 5s (--collective-timeout) must exceed the collective watchdog 5s (--stall-after) and the heartbeat 50ms"},
		{"recovery before the watchdog", pdproto.RoleDecode, func(c *Config) { c.CollectiveTimeout = time.Second },
			"collective timeout 1s (--collective-timeout) must exceed the collective watchdog 5s (--stall-after)"},
		{"recovery without a watchdog", pdproto.RoleColocated, func(c *Config) { c.CollectiveWatchdog, c.CollectiveTimeout = -1, time.Second }, ""},
		{"recovery within a heartbeat", pdproto.RoleColocated, func(c *Config) { c.CollectiveWatchdog, c.CollectiveTimeout = -1, c.Heartbeat },
			"collective timeout 50ms (--collective-timeout) must exceed the collective watchdog off (--stall-after) and the heartbeat 50ms"},
		{"negative collective timeout", pdproto.RoleColocated, func(c *Config) { c.CollectiveTimeout = -time.Second }, "collective timeout -1s (--collective-timeout)"},
		{"heartbeat past the watchdog", pdproto.RoleColocated, func(c *Config) { c.CollectiveWatchdog = c.Heartbeat },
			"heartbeat 50ms must be shorter than the collective watchdog 50ms (--stall-after)"},

		// The engine's settings name their flags.
		{"page size", pdproto.RoleDecode, func(c *Config) { c.PageSize = -1 }, "page size -1 (--page-size) must be positive"},
		{"tp", pdproto.RolePrefill, func(c *Config) { c.TP = -1 }, "tp -1 (--tp) must be positive"},
		{"max running", pdproto.RoleColocated, func(c *Config) { c.MaxBatchTokens = 2 }, "batch tokens 2 (--max-batch-tokens) below max running 8 (--max-running)"},
		{"fault", pdproto.RoleColocated, func(c *Config) { c.Faults = []string{"nope"} }, `unknown fault "nope"`},

		// The PD settings the engine reads.
		{"wildcard PD host", pdproto.RoleDecode, func(c *Config) { c.PD.Host = "0.0.0.0" }, `PD host "0.0.0.0" (--pd-host) binds every address`},
		{"negative send timeout", pdproto.RolePrefill, func(c *Config) { c.PD.SendTimeout = -time.Second }, "PD send timeout -1s (--send-timeout) must not be negative"},
		{"negative peer sockets", pdproto.RoleDecode, func(c *Config) { c.PD.MaxPeerSockets = -1 }, "PD max peer sockets -1 (--max-peer-sockets) must not be negative"},
		{"negative cache size", pdproto.RoleDecode, func(c *Config) { c.PD.BootstrapCacheSize = -2 }, "PD bootstrap cache size -2 (--bootstrap-cache-size)"},
		{"heartbeat interval past its timeout", pdproto.RoleDecode, func(c *Config) { c.PD.HeartbeatInterval = c.PD.HeartbeatTimeout },
			"PD heartbeat interval 3s (--heartbeat-interval) must be positive and shorter than the heartbeat timeout 3s (--heartbeat-timeout)"},
		{"negative heartbeat interval", pdproto.RolePrefill, func(c *Config) { c.PD.HeartbeatInterval = -1 }, "PD heartbeat interval -1ns (--heartbeat-interval)"},

		// The machine's settings, in the machine's words.
		{"negative bootstrap timeout", pdproto.RoleDecode, func(c *Config) { c.PD.BootstrapTimeout = -time.Second },
			"serve: rooms: bootstrap timeout -1s (--bootstrap-timeout) must be positive"},
		{"negative transfer timeout", pdproto.RolePrefill, func(c *Config) { c.PD.TransferTimeout = -time.Second },
			"serve: rooms: transfer timeout -1s (--transfer-timeout) must be positive"},
		{"negative abort-ack timeout", pdproto.RoleDecode, func(c *Config) { c.PD.AbortAckTimeout = -1 }, "serve: rooms: abort-ack timeout -1ns (--abort-ack-timeout)"},
		{"negative heartbeat timeout", pdproto.RoleDecode, func(c *Config) { c.PD.HeartbeatTimeout = -time.Second },
			"serve: rooms: heartbeat timeout -1s (--heartbeat-timeout) must be positive"},
		{"QUEUED within no bootstrap time", pdproto.RoleDecode, func(c *Config) { c.PD.BootstrapTimeout = 2 }, "serve: rooms: QUEUED every 0s must be positive"},
		{"more ranks than votes hold", pdproto.RolePrefill, func(c *Config) { c.TP = 1 << 17 }, "serve: rooms: rank 131071: want 0 to 65535"},
		{"no machine, no machine rules", pdproto.RoleColocated, func(c *Config) { c.PD.BootstrapTimeout, c.PD.HeartbeatTimeout = -1, -1 }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			c.Role, c.Backend, c.KVTokens = tc.role, cpuBackend, 1024
			tc.edit(&c)
			err := c.Validate(nil)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%v; want %q", err, tc.want)
			}
			// One mistake, one refusal: no rule says it again in other words.
			if n := strings.Count(err.Error(), "serve: "); n != 1 {
				t.Errorf("%d refusals, want 1:\n%v", n, err)
			}
		})
	}
}
