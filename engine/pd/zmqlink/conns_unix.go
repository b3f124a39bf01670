//go:build unix

package zmqlink

import (
	"net/netip"
	"syscall"
)

// peer is the remote address of fd when fd is a connected socket whose
// local port is the Inbox's; any descriptor counts, with no address,
// until the Inbox is bound on a TCP port.
func (p *sysProbe) peer(fd int32) (netip.AddrPort, bool) {
	port := int(p.port.Load())
	if port == 0 {
		return netip.AddrPort{}, true
	}
	sa, err := syscall.Getsockname(int(fd))
	if err != nil || sockPort(sa) != port {
		return netip.AddrPort{}, false
	}
	sa, err = syscall.Getpeername(int(fd))
	if err != nil {
		return netip.AddrPort{}, false
	}
	switch a := sa.(type) {
	case *syscall.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)), true
	case *syscall.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port)), true
	}
	return netip.AddrPort{}, false
}

func sockPort(sa syscall.Sockaddr) int {
	switch a := sa.(type) {
	case *syscall.SockaddrInet4:
		return a.Port
	case *syscall.SockaddrInet6:
		return a.Port
	}
	return -1
}

// shutdown ends fd if it is still the connection to peer.
func (p *sysProbe) shutdown(fd int32, peer netip.AddrPort) bool {
	if !peer.IsValid() {
		return false
	}
	now, ok := p.peer(fd)
	return ok && now == peer && syscall.Shutdown(int(fd), syscall.SHUT_RDWR) == nil
}
