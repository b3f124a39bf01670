//go:build redteam

package main

import "testing"

// TestRedTeamIndexKSwitchesUnderLoad is the adversarial round's case: 30
// live switches under 32 clients, 0 errors and 0 corrupt outputs.
func TestRedTeamIndexKSwitchesUnderLoad(t *testing.T) { indexKSwitchesUnderLoad(t, 30, 32) }
