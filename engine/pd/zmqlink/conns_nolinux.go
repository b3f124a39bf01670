//go:build unix && !linux

package zmqlink

// handshaken cannot tell without TCP_INFO: a connection is known past its
// handshake only once it is older than the handshake timeout.
func (p *sysProbe) handshaken(fd int32) bool { return false }
