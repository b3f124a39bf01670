//go:build redteam

package zmqlink

import (
	"fmt"
	"testing"
)

// TestRedTeamSilentFloodFromManySources: the flood of
// TestRedTeamSilentConnectionsCannotShutMembersOut from eight source
// addresses, so that the pending connections as a whole reach their
// bound and the oldest of all is shed: a member gets in when its
// handshake is quicker than the flood's next MaxPending connections.
func TestRedTeamSilentFloodFromManySources(t *testing.T) {
	for _, b := range backends {
		for _, auth := range []*PlainAuth{nil, &testAuth} {
			t.Run(fmt.Sprintf("%s/auth=%v", b.name, auth != nil), func(t *testing.T) {
				testSilentFlood(t, b.zc, auth, 8)
			})
		}
	}
}
