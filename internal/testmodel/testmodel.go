// Package testmodel gives tests a real built-in model file: generated once
// per test binary into a temporary folder and opened fresh for each caller.
package testmodel

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
)

var (
	mu    sync.Mutex
	dir   string
	paths = map[builtin.Spec]string{}
)

// Path returns the file of spec, generating it on first use.
func Path(t testing.TB, spec builtin.Spec) string {
	t.Helper()
	mu.Lock()
	defer mu.Unlock()
	if p, ok := paths[spec]; ok {
		return p
	}
	if dir == "" {
		d, err := os.MkdirTemp("", "pdkit-testmodel-")
		if err != nil {
			t.Fatal(err)
		}
		dir = d
	}
	p := filepath.Join(dir, spec.FileName())
	if err := builtin.WriteFile(p, spec); err != nil {
		t.Fatal(err)
	}
	paths[spec] = p
	return p
}

// Open loads spec's model and closes it when the test ends.
func Open(t testing.TB, spec builtin.Spec) *model.Model {
	t.Helper()
	m, err := model.Open(Path(t, spec))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// Own writes spec's model to a file of the test's own, which it may
// change under the model (the shared files of Path must not be), and
// opens it; the model is closed when the test ends.
func Own(t testing.TB, spec builtin.Spec) (path string, m *model.Model) {
	t.Helper()
	path = filepath.Join(t.TempDir(), spec.FileName())
	if err := builtin.WriteFile(path, spec); err != nil {
		t.Fatal(err)
	}
	m, err := model.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return path, m
}

// FlipBetweenSamples flips one byte of the file at path where the model
// fingerprint's sampled blocks do not read (a little past the middle of a
// small file's data), keeping the file's size and modification time: a
// change that only a full hash sees.
func FlipBetweenSamples(t testing.TB, path string) {
	t.Helper()
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	off := info.Size()/2 + 4096 + 100
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(path, info.ModTime(), info.ModTime()); err != nil {
		t.Fatal(err)
	}
}

// Cleanup removes the generated files; call it from TestMain after m.Run.
func Cleanup() {
	mu.Lock()
	defer mu.Unlock()
	if dir != "" {
		os.RemoveAll(dir)
		dir = ""
		paths = map[builtin.Spec]string{}
	}
}

// Prompts returns n seeded random prompts of minLen to maxLen tokens, drawn
// from the vocabulary past its three control tokens.
func Prompts(seed uint64, n, minLen, maxLen, vocab int) [][]int32 {
	rng := rand.New(rand.NewPCG(seed, seed))
	out := make([][]int32, n)
	for i := range out {
		p := make([]int32, minLen+rng.IntN(maxLen-minLen+1))
		for j := range p {
			p[j] = int32(3 + rng.IntN(vocab-3))
		}
		out[i] = p
	}
	return out
}

// Main runs a package's tests and removes the generated models afterwards;
// call it from TestMain.
func Main(m *testing.M) {
	code := m.Run()
	Cleanup()
	os.Exit(code)
}
