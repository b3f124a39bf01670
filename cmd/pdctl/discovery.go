package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"time"

	"github.com/pdkit/pdkit/api/debug"
)

// The last discovery pdctl made through each router, kept under
// $PDKIT_HOME (default: the user's cache folder, pdkit), so that diagnose
// can still reach the servers directly when the router does not answer,
// and name the router.

// discovery is one router's servers as pdctl last discovered them.
type discovery struct {
	Router  string                `json:"router"`
	Taken   time.Time             `json:"taken"`
	Servers []debug.ClusterServer `json:"servers"`
}

// pdkitHome is $PDKIT_HOME, else the user's cache folder's pdkit.
func pdkitHome(f *factory) (string, error) {
	if h := f.getenv("PDKIT_HOME"); h != "" {
		return h, nil
	}
	c, err := os.UserCacheDir()
	if err != nil {
		return "", errors.New("no cache folder: set PDKIT_HOME")
	}
	return filepath.Join(c, "pdkit"), nil
}

// discoveryPath is where the discovery through router is kept.
func discoveryPath(f *factory, router string) (string, error) {
	home, err := pdkitHome(f)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(router))
	return filepath.Join(home, "pdctl", "discovery", hex.EncodeToString(sum[:8])+".json"), nil
}

// saveDiscovery keeps servers as router's last discovery; a failure to
// write it costs nothing but the fallback, so it is ignored.
func saveDiscovery(f *factory, router string, servers []debug.ClusterServer, now time.Time) {
	p, err := discoveryPath(f, router)
	if err != nil {
		return
	}
	b, err := json.Marshal(discovery{Router: router, Taken: now, Servers: servers})
	if err != nil || os.MkdirAll(filepath.Dir(p), 0o700) != nil {
		return
	}
	tmp := p + ".tmp"
	if os.WriteFile(tmp, b, 0o600) == nil {
		os.Rename(tmp, p)
	}
}

// loadDiscovery is router's last discovery; an error when pdctl kept none.
func loadDiscovery(f *factory, router string) (*discovery, error) {
	p, err := discoveryPath(f, router)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	var d discovery
	if err := json.Unmarshal(b, &d); err != nil || d.Router != router || len(d.Servers) == 0 {
		return nil, errors.New("no usable discovery kept for " + router)
	}
	return &d, nil
}
