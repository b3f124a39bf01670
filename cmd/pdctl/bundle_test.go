package main

import (
	"archive/tar"
	"compress/gzip"
	"encoding/json"
	"io"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/api/debug"
)

// readBundle returns the files of the archive at path in order, and their
// contents by name.
func readBundle(t *testing.T, path string) ([]string, map[string]string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	var names []string
	files := map[string]string{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		files[h.Name] = string(b)
	}
	return names, files
}

func hostOf(t *testing.T, u string) string {
	p, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	return p.Host
}

// TestBundle collects a bundle of the live cluster and opens it.
func TestBundle(t *testing.T) {
	c := newCluster(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "b.tar.gz")
	code, stdout, stderr := c.pdctl(t, false, "bundle", "-o", out, "--window", "500ms")
	if code != exitOK || stdout != "" {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	names, files := readBundle(t, out)
	if want := "wrote " + out + ": " + itoa(len(names)) + " files, 0 failures\n"; !strings.HasSuffix(stderr, want) {
		t.Errorf("stderr %q, want it to end with %q", stderr, want)
	}
	if names[0] != "MANIFEST" {
		t.Errorf("the first file is %s", names[0])
	}
	want := []string{"MANIFEST", "cluster.json", "diagnose.json", "diagnose.txt"}
	for _, s := range []struct{ role, url string }{{"prefill", c.prefill.ts.URL}, {"decode", c.decode.ts.URL}} {
		d := s.role + "-" + hostOf(t, s.url) + "/"
		for _, n := range []string{"info.json", "health.json", "settings.json", "state.json", "steps.json", "collectives.json",
			"requests.json", "pd.json", "faults.json", "gpu.json", "hicache.json", "decisions.json", "stacks.txt", "stacks-rank-0.txt", "stacks-rank-1.txt", "metrics.txt"} {
			want = append(want, d+n)
		}
		if !strings.Contains(files[d+"metrics.txt"], "pdkit_") {
			t.Errorf("%smetrics.txt has no pdkit_ metric:\n%.500s", d, files[d+"metrics.txt"])
		}
		if !strings.Contains(files[d+"stacks.txt"], "goroutine profile:") {
			t.Errorf("%sstacks.txt: %.200s", d, files[d+"stacks.txt"])
		}
		var st debug.Settings
		if err := json.Unmarshal([]byte(files[d+"settings.json"]), &st); err != nil || st.Role != s.role || st.PD == nil ||
			debug.Duration(st.PD.TransferTimeoutMS) != testConfig.PD.TransferTimeout {
			t.Errorf("%ssettings.json: %s, %v", d, files[d+"settings.json"], err)
		}
		var state debug.StateResponse
		if err := json.Unmarshal([]byte(files[d+"state.json"]), &state); err != nil || state.Settings.Role != s.role || state.Snapshot == nil {
			t.Errorf("%sstate.json: %.300s, %v", d, files[d+"state.json"], err)
		}
		var hc debug.HiCacheResponse
		if err := json.Unmarshal([]byte(files[d+"hicache.json"]), &hc); err != nil || !hc.PrefixCache || hc.On || len(hc.Ranks) != 2 {
			t.Errorf("%shicache.json: %.300s, %v", d, files[d+"hicache.json"], err)
		}
		var dec debug.DecisionsResponse
		if err := json.Unmarshal([]byte(files[d+"decisions.json"]), &dec); err != nil || len(dec.Ranks) != 2 || dec.LogLen == 0 ||
			len(dec.Ranks[0].Records) == 0 || dec.Divergence != nil {
			t.Errorf("%sdecisions.json: %.300s, %v", d, files[d+"decisions.json"], err)
		}
		if files[d+"health.json"] != "{\n  \"healthy\": true\n}\n" {
			t.Errorf("%shealth.json: %s", d, files[d+"health.json"])
		}
	}
	slices.Sort(want)
	got := slices.Clone(names)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("files:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	manifest := files["MANIFEST"]
	for _, n := range names[1:] {
		if !strings.Contains(manifest, "\n"+n+"\t") {
			t.Errorf("MANIFEST does not list %s:\n%s", n, manifest)
		}
		if strings.HasSuffix(n, ".json") && !json.Valid([]byte(files[n])) {
			t.Errorf("%s is not JSON: %.200s", n, files[n])
		}
	}
	if !strings.HasSuffix(manifest, "\nfailures:\nnone\n") {
		t.Errorf("MANIFEST failures:\n%s", manifest)
	}
	if files["diagnose.txt"] != "healthy\n" || files["diagnose.json"] != "[]\n" {
		t.Errorf("diagnose: %q %q", files["diagnose.txt"], files["diagnose.json"])
	}
	if e, _ := filepath.Glob(filepath.Join(dir, ".*")); len(e) > 0 {
		t.Errorf("temporary files left: %v", e)
	}
}

// TestBundleFailures: an unreachable server is a failure in MANIFEST and
// the rest is collected; nothing reachable writes nothing (exit 2).
func TestBundleFailures(t *testing.T) {
	c := newCluster(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "b.tar.gz")
	code, _, stderr := c.pdctl(t, false, "--server", c.decode.ts.URL, "--server", "http://127.0.0.1:1",
		"bundle", "-o", out, "--window", "200ms")
	if code != exitOK {
		t.Fatalf("exit %d\nstderr:\n%s", code, stderr)
	}
	_, files := readBundle(t, out)
	d := "decode-" + hostOf(t, c.decode.ts.URL) + "/"
	if !strings.Contains(files[d+"metrics.txt"], "pdkit_") || files["cluster.json"] != "" {
		t.Errorf("files: %v", slices.Sorted(maps.Keys(files)))
	}
	m := files["MANIFEST"]
	for _, want := range []string{"\nunknown-127.0.0.1:1/: the server at http://127.0.0.1:1 did not answer\n",
		"\nunknown-127.0.0.1:1/metrics.txt: GET http://127.0.0.1:1/metrics: dial tcp 127.0.0.1:1: connect: connection refused\n"} {
		if !strings.Contains(m, want) {
			t.Errorf("MANIFEST lacks %q:\n%s", want, m)
		}
	}
	if !strings.Contains(files["diagnose.txt"], "critical peer-unreachable http://127.0.0.1:1: ") {
		t.Errorf("diagnose.txt:\n%s", files["diagnose.txt"])
	}

	none := filepath.Join(dir, "none.tar.gz")
	code, _, stderr = runArgs(t, "--server", "http://127.0.0.1:1", "bundle", "-o", none)
	if code != exitNoRun || !strings.HasPrefix(stderr, "collecting from 1 server…\npdctl: cannot run: no server answered: ") {
		t.Errorf("nothing reachable: exit %d, stderr %q", code, stderr)
	}
	if _, err := os.Stat(none); !os.IsNotExist(err) {
		t.Errorf("a bundle was written: %v", err)
	}
	if code, _, _ := runArgs(t, "bundle"); code != exitUsage {
		t.Errorf("bundle without -o: exit %d", code)
	}
}
