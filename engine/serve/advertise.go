package serve

import (
	"fmt"
	"net"
	"strings"
)

// advertiseHost is the host peers dial the ranks' sockets at.
func (c PDConfig) advertiseHost() string {
	if c.AdvertiseHost != "" {
		return c.AdvertiseHost
	}
	return c.Host
}

// isWildcardHost reports whether h binds every address (0.0.0.0, ::, *, or
// empty) rather than naming one a peer can dial.
func isWildcardHost(h string) bool {
	if h == "" || h == "*" {
		return true
	}
	ip := net.ParseIP(strings.Trim(h, "[]"))
	return ip != nil && ip.IsUnspecified()
}

// advertisedEndpoint is a bound ZeroMQ endpoint ("tcp://0.0.0.0:41234") as
// peers dial it: its host replaced by host, its port, chosen at bind time,
// kept.
func advertisedEndpoint(bound, host string) (string, error) {
	addr, ok := strings.CutPrefix(bound, "tcp://")
	if !ok {
		return "", fmt.Errorf("pd: bound endpoint %q is not tcp://HOST:PORT", bound)
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("pd: bound endpoint %q: %w", bound, err)
	}
	if isWildcardHost(host) {
		return "", fmt.Errorf("pd: endpoint %q would advertise %q, every address and none a peer can dial: set the advertise host", bound, host)
	}
	return "tcp://" + net.JoinHostPort(strings.Trim(host, "[]"), port), nil
}
