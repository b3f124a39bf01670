package zmqlink

import "golang.org/x/sys/unix"

// handshaken reports whether fd's peer has acknowledged more than the
// Inbox's greeting (TCP_INFO's bytes acked, Linux 4.1 and later).
func (p *sysProbe) handshaken(fd int32) bool {
	info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
	return err == nil && info.Bytes_acked > greetingBytes
}
