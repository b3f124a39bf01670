//go:build !unix

package zmqlink

import "net/netip"

// Without shutdown(2) on libzmq's descriptors the cap only counts.
func (p *sysProbe) peer(fd int32) (netip.AddrPort, bool)        { return netip.AddrPort{}, true }
func (p *sysProbe) shutdown(fd int32, peer netip.AddrPort) bool { return false }
func (p *sysProbe) handshaken(fd int32) bool                    { return false }
