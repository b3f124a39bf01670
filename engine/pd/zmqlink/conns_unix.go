//go:build unix

package zmqlink

import "syscall"

// isConnOnPort reports whether fd is a connected socket whose local port
// is port.
func isConnOnPort(fd, port int) bool {
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		return false
	}
	var local int
	switch a := sa.(type) {
	case *syscall.SockaddrInet4:
		local = a.Port
	case *syscall.SockaddrInet6:
		local = a.Port
	default:
		return false
	}
	if local != port {
		return false
	}
	_, err = syscall.Getpeername(fd)
	return err == nil
}

// shutdownConnOnPort ends the connection fd if it is one on port, and
// reports whether it did.
func shutdownConnOnPort(fd, port int) bool {
	return isConnOnPort(fd, port) && syscall.Shutdown(fd, syscall.SHUT_RDWR) == nil
}
