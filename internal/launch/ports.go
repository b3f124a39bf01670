package launch

import (
	"fmt"
	"net"
)

// FreePorts reserves n distinct free TCP ports on 127.0.0.1: it listens on
// port 0 n times at once, notes the ports the kernel chose and closes the
// listeners. Between that close and a child's bind another process may
// take a port; a child then fails with "address already in use", and
// Launch retries once with fresh ports.
func FreePorts(n int) ([]int, error) {
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("launch: reserve a free port: %w", err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
