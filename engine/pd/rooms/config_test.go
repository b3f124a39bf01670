package rooms

import (
	"strings"
	"testing"
	"time"
)

// validConfig is a decode rank's configuration that Validate accepts.
func validConfig() Config {
	return Config{Role: Decode, Rank: 1, PageSize: 4, BootstrapTimeout: 10 * time.Second, TransferTimeout: 30 * time.Second,
		InflightTimeout: 10 * time.Second, AbortAckTimeout: 5 * time.Second, HeartbeatTimeout: 3 * time.Second,
		QueuedInterval: 500 * time.Millisecond}
}

// Validate refuses what the machine cannot run, naming the setting as the
// flag that sets it on a server, and New refuses the same.
func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string // "" accepts
	}{
		{"decode", func(*Config) {}, ""},
		{"prefill without a QUEUED interval", func(c *Config) { c.Role, c.QueuedInterval = Prefill, 0 }, ""},
		{"no request timeout", func(c *Config) { c.RequestTimeout = 0 }, ""},
		{"highest rank", func(c *Config) { c.Rank = maxRank }, ""},
		{"role", func(c *Config) { c.Role = 7 }, "role 7: want prefill or decode"},
		{"negative rank", func(c *Config) { c.Rank = -1 }, "rank -1: want 0 to"},
		{"rank past the votes' bits", func(c *Config) { c.Rank = maxRank + 1 }, "rank 65536: want 0 to 65535"},
		{"page size", func(c *Config) { c.PageSize = 0 }, "page size 0 (--page-size) must be positive"},
		{"bootstrap timeout", func(c *Config) { c.BootstrapTimeout = 0 }, "bootstrap timeout 0s (--bootstrap-timeout) must be positive"},
		{"transfer timeout", func(c *Config) { c.TransferTimeout = -time.Second }, "transfer timeout -1s (--transfer-timeout) must be positive"},
		{"inflight timeout", func(c *Config) { c.InflightTimeout = 0 }, "(--inflight-timeout) must be positive"},
		{"abort-ack timeout", func(c *Config) { c.AbortAckTimeout = 0 }, "(--abort-ack-timeout) must be positive"},
		{"heartbeat timeout", func(c *Config) { c.HeartbeatTimeout = -1 }, "(--heartbeat-timeout) must be positive"},
		{"negative request timeout", func(c *Config) { c.RequestTimeout = -time.Second }, "request timeout -1s (--request-timeout) must not be negative"},
		{"decode without a QUEUED interval", func(c *Config) { c.QueuedInterval = 0 }, "QUEUED every 0s must be positive"},
		{"QUEUED past the bootstrap timeout", func(c *Config) { c.QueuedInterval = c.BootstrapTimeout }, "within the prefill's bootstrap timeout 10s (--bootstrap-timeout)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := validConfig()
			tc.edit(&c)
			err := c.Validate()
			_, nerr := New(c)
			switch {
			case tc.want == "" && (err != nil || nerr != nil):
				t.Errorf("Validate: %v; New: %v; want both nil", err, nerr)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Validate: %v; want %q", err, tc.want)
			case tc.want != "" && (nerr == nil || nerr.Error() != err.Error()):
				t.Errorf("New: %v; want Validate's %v", nerr, err)
			}
		})
	}
}
