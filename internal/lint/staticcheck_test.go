package lint

import (
	"os/exec"
	"strings"
	"testing"
)

// TestStaticcheck runs staticcheck over the whole module, in the default
// build (no tags), and fails with its findings. The version is the
// module's tool dependency (go.mod's tool line), so "go tool" builds it
// from the module cache; the checks are staticcheck.conf's, at the module
// root. A finding that is a false positive is silenced where it stands,
// with "//lint:ignore CHECK reason".
func TestStaticcheck(t *testing.T) {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	root, _ := moduleRoot(t)
	cmd := exec.CommandContext(t.Context(), goCmd, "tool", "staticcheck", "./...")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("go tool staticcheck ./...: %v\n%s\nfix each finding, or silence a false positive with //lint:ignore CHECK reason",
			err, strings.TrimRight(string(out), "\n"))
	}
}
