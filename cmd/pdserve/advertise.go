package main

import (
	"net"
	"strconv"
	"strings"
)

// advertiseUsage is the --advertise-host flag's help, the same on every role.
const advertiseUsage = "host or address other hosts reach this server at, used in every URL and endpoint it advertises (bootstrap URL, ZeroMQ endpoints, /pd/v1/info, logs); default: the bind address, which must then not be a wildcard such as 0.0.0.0"

// isWildcardHost reports whether h binds every address (0.0.0.0, ::, or
// empty) rather than naming one a peer can reach.
func isWildcardHost(h string) bool {
	if h == "" || h == "*" {
		return true
	}
	ip := net.ParseIP(strings.Trim(h, "[]"))
	return ip != nil && ip.IsUnspecified()
}

// advertiseHost is the host a server advertises for an address bound by
// bindFlag to bind: --advertise-host when given, else bind itself. A
// wildcard is refused: peers told 0.0.0.0 would dial themselves.
func advertiseHost(bind, advertise, bindFlag string) (string, error) {
	if advertise != "" {
		if isWildcardHost(advertise) {
			return "", usagef("--advertise-host %q is every address, not one other hosts can reach: give this host's address or DNS name", advertise)
		}
		return strings.Trim(advertise, "[]"), nil
	}
	if isWildcardHost(bind) {
		return "", usagef("%s %q binds every address and names none that peers can reach: set --advertise-host (PD_ADVERTISE_HOST) to this host's address or DNS name", bindFlag, bind)
	}
	return strings.Trim(bind, "[]"), nil
}

// checkAdvertise refuses a wildcard --advertise-host on a server that
// advertises nothing to peers (the router, a colocated server), where an
// unset one is fine.
func checkAdvertise(advertise string) error {
	if advertise == "" {
		return nil
	}
	_, err := advertiseHost("", advertise, "--host")
	return err
}

// httpURL is the base URL of host and port.
func httpURL(host string, port int) string {
	return "http://" + net.JoinHostPort(host, strconv.Itoa(port))
}

// listenPort is a listener's port.
func listenPort(ln net.Listener) int {
	if ta, ok := ln.Addr().(*net.TCPAddr); ok {
		return ta.Port
	}
	return 0
}

// clientURL is what a router or colocated server logs as where it serves:
// the advertised URL, or, bound to every address without --advertise-host,
// the listen address said to be one (nothing is handed to peers, so
// nothing is refused).
func clientURL(ln net.Listener, bind, advertise string) string {
	if host, err := advertiseHost(bind, advertise, "--host"); err == nil {
		return httpURL(host, listenPort(ln))
	}
	return "every address (--advertise-host names the one to reach), listening on http://" + ln.Addr().String()
}
