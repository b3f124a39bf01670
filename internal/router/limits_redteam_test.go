//go:build redteam

package router

import (
	"testing"
	"testing/synctest"
)

// The flood of the hostile-user round: 1,000 slow-body connections at once.
func TestRedTeamSlowBodyFlood(t *testing.T) {
	synctest.Test(t, func(t *testing.T) { testSlowBody(t, 1000) })
}
