//go:build !unix

package zmqlink

// Without shutdown(2) on libzmq's descriptors the cap only counts.
func isConnOnPort(fd, port int) bool       { return true }
func shutdownConnOnPort(fd, port int) bool { return false }
