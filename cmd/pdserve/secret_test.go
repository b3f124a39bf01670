package main

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestClusterSecretRequiredBeyondLoopback: without a secret a PD server
// may listen on loopback only (and says so once); a secret lifts that; a
// short one is refused.
func TestClusterSecretRequiredBeyondLoopback(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if s, err := (secretFlags{}).load(log, "127.0.0.1", "::1", "localhost"); s != nil || err != nil {
		t.Fatalf("loopback without a secret: %v %v", s, err)
	}
	if strings.Count(logs.String(), "no cluster secret") != 1 {
		t.Errorf("log: %q", logs.String())
	}
	if _, err := (secretFlags{}).load(log, "127.0.0.1", "10.0.0.5"); err == nil || !strings.Contains(err.Error(), "10.0.0.5 is not a loopback address") {
		t.Fatalf("beyond loopback without a secret: %v", err)
	}
	if s, err := (secretFlags{value: "a cluster secret of 33 bytes long"}).load(log, "0.0.0.0"); err != nil || !s.Set() {
		t.Fatalf("with a secret: %v", err)
	}
	if _, err := (secretFlags{value: "short"}).load(log, "127.0.0.1"); err == nil {
		t.Fatal("a short secret was taken")
	}
}

// TestLaunchGeneratesClusterSecret: launch gives its children a fresh
// secret, in their environment and in a file of mode 600 for pdctl,
// unless the environment has one.
func TestLaunchGeneratesClusterSecret(t *testing.T) {
	env, file, err := withClusterSecret([]string{"PD_MAX_RUNNING=3"})
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(filepath.Dir(file))
	var given string
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PD_CLUSTER_SECRET="); ok {
			given = v
		}
	}
	st, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(file)
	if len(given) < 32 || strings.TrimSpace(string(b)) != given || st.Mode().Perm() != 0o600 {
		t.Fatalf("secret %q, file %q mode %v", given, b, st.Mode().Perm())
	}
	other, _, _ := withClusterSecret([]string{"PD_CLUSTER_SECRET_FILE=/etc/pdkit/secret"})
	if len(other) != 1 {
		t.Fatalf("a secret from the environment was replaced: %q", other)
	}
	// An empty variable is no secret: launch makes one.
	empty, f, err := withClusterSecret([]string{"PD_CLUSTER_SECRET="})
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(filepath.Dir(f))
	if f == "" || len(empty) != 2 {
		t.Fatalf("an empty PD_CLUSTER_SECRET: env %q, file %q", empty, f)
	}
}

// TestConfigHidesTheClusterSecret: pdserve config shows that the secret is
// set, from the flag or the environment, and never prints it.
func TestConfigHidesTheClusterSecret(t *testing.T) {
	const secret = "0123456789abcdef-supersecret"
	t.Setenv("PD_CLUSTER_SECRET", secret)
	for _, args := range [][]string{{"config", "prefill"}, {"config", "decode", "--json"}, {"config", "prefill", "--cluster-secret", secret + "2"}} {
		out, stderr, code := run(t, args...)
		if code != 0 || strings.Contains(out, secret) || !strings.Contains(out, "***") {
			t.Errorf("%q: exit %d, stderr %q\n%s", args, code, stderr, out)
		}
	}
}
