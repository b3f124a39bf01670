package model

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"
)

// A model's identity: a fingerprint of the weights taken at load, and a
// watch on the file they were loaded from. Servers publish both, so that
// servers of one cluster that serve different weights, or a file changed
// under a running server (outputs change, since the weights are mapped
// from it), can be named.

// fingerprintSamples and fingerprintBlock size the sampled hash: the
// file's head (header, metadata and tensor table, up to the data section)
// and this many blocks spread evenly over the tensor data, about 256 KiB
// read, whatever the model's size.
const (
	fingerprintSamples = 64
	fingerprintBlock   = 4 << 10
)

// sampledHash hashes the head of r (size bytes, its data section at
// dataOffset) and fingerprintSamples blocks of its data: "sha256s:" and 16
// hex digits.
func sampledHash(r io.ReaderAt, size int64, dataOffset uint64) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "%d\n", size)
	head := min(int64(dataOffset), size)
	if _, err := io.Copy(h, io.NewSectionReader(r, 0, head)); err != nil {
		return "", err
	}
	span := size - head
	buf := make([]byte, fingerprintBlock)
	for i := range int64(fingerprintSamples) {
		if span <= 0 {
			break
		}
		off := head + span*i/fingerprintSamples
		n, err := r.ReadAt(buf[:min(int64(len(buf)), size-off)], off)
		if err != nil && err != io.EOF {
			return "", err
		}
		h.Write(buf[:n])
	}
	return "sha256s:" + hex.EncodeToString(h.Sum(nil))[:16], nil
}

// fullHashAtLoadMax is the largest file hashed whole at load (about a
// second of reading at the worst); a larger one gets its full hash at the
// first VerifyFile, which is then the baseline.
const fullHashAtLoadMax = 1 << 30

// FileCheck is what a check of the model's file found.
type FileCheck struct {
	Path        string
	Fingerprint string // taken at load
	// SHA256 is the whole file's hash, taken at load (files up to 1 GiB)
	// or at the first VerifyFile; empty before either.
	SHA256  string
	Changed bool
	Why     string // what changed; empty when nothing did
	Checked time.Time
	// Verified is the last VerifyFile's time; zero before the first.
	Verified time.Time
}

// FullCheck is what a full rehash of the model's file (VerifyFile) found.
type FullCheck struct {
	Path string
	// Baseline is the full hash it was compared with (taken at load, or
	// by an earlier verify); SHA256 the file's now.
	Baseline, SHA256 string
	// First says there was no baseline: this hash becomes it.
	First bool
	Took  time.Duration
}

// Matches reports whether the file is whole what the baseline was; false
// on a first verify, which compared nothing (it set the baseline).
func (c FullCheck) Matches() bool { return !c.First && c.SHA256 == c.Baseline }

// ErrVerifying is VerifyFile's answer while another verify reads the file.
var ErrVerifying = errors.New("model: a full rehash of the model file is under way")

// fileWatch is the model file's identity at load.
type fileWatch struct {
	path        string
	info        os.FileInfo
	fingerprint string
	dataOffset  uint64

	mu   sync.Mutex
	last FileCheck
	// full is the baseline full hash ("" until taken); fullChanged what a
	// full rehash found changed ("" while none did): sticky, the sampled
	// check cannot see it.
	full, fullChanged string
	verifying         sync.Mutex // one full rehash at a time
}

func newFileWatch(path string, dataOffset uint64) (*fileWatch, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	info, err := fh.Stat()
	if err != nil {
		return nil, err
	}
	fp, err := sampledHash(fh, info.Size(), dataOffset)
	if err != nil {
		return nil, fmt.Errorf("model: fingerprint of %s: %w", path, err)
	}
	w := &fileWatch{path: path, info: info, fingerprint: fp, dataOffset: dataOffset}
	if info.Size() <= fullHashAtLoadMax {
		if w.full, err = fullHash(context.Background(), fh); err != nil {
			return nil, fmt.Errorf("model: hash of %s: %w", path, err)
		}
	}
	w.last = FileCheck{Path: path, Fingerprint: fp, SHA256: w.full}
	return w, nil
}

// fullHash is the whole of r's SHA-256, "sha256:" and 64 hex digits,
// read in blocks that each check ctx.
func fullHash(ctx context.Context, r io.Reader) (string, error) {
	h := sha256.New()
	buf := make([]byte, 4<<20)
	for {
		if err := ctx.Err(); err != nil {
			return "", err
		}
		n, err := r.Read(buf)
		h.Write(buf[:n])
		if err == io.EOF {
			return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
		}
		if err != nil {
			return "", err
		}
	}
}

// VerifyFile rehashes the whole model file now and compares it with the
// baseline full hash (taken at load, or by the first VerifyFile, which
// sets it): the sampled check every few seconds reads about 256 KiB, and a
// change between its samples, with the file's size and time kept, is seen
// only so. A file found changed stays changed in CheckFile's answers. One
// runs at a time (ErrVerifying); it reads the whole file, so it is for an
// operator to ask for, never on a timer.
func (m *Model) VerifyFile(ctx context.Context, now func() time.Time) (FullCheck, error) {
	w := m.watch
	if w == nil {
		return FullCheck{}, errors.New("model: not opened from a file")
	}
	if !w.verifying.TryLock() {
		return FullCheck{}, ErrVerifying
	}
	defer w.verifying.Unlock()
	start := now()
	fh, err := os.Open(w.path)
	if err != nil {
		return FullCheck{}, err
	}
	defer fh.Close()
	sum, err := fullHash(ctx, fh)
	if err != nil {
		return FullCheck{}, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	c := FullCheck{Path: w.path, Baseline: w.full, SHA256: sum, First: w.full == "", Took: now().Sub(start)}
	switch {
	case c.First:
		w.full = sum
	case !c.Matches() && w.fullChanged == "": // not a first verify: the case above
		w.fullChanged = fmt.Sprintf("its full hash changed under the running server (%s now, %s at load)", sum, w.full)
	}
	w.last.SHA256, w.last.Verified = w.full, now()
	if w.fullChanged != "" {
		w.last.Changed, w.last.Why = true, w.fullChanged
	}
	return c, nil
}

// Fingerprint is the sampled hash of the weights taken at load; empty for a
// model that was not opened from a file.
func (m *Model) Fingerprint() string {
	if m.watch == nil {
		return ""
	}
	return m.watch.fingerprint
}

// CheckFile compares the model's file with what was loaded: the same file
// (device and inode), size and modification time, and the same sampled
// hash. At most one check runs per every; a call within it returns the
// last one. Without a file it reports nothing changed.
func (m *Model) CheckFile(now time.Time, every time.Duration) FileCheck {
	w := m.watch
	if w == nil {
		return FileCheck{}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.last.Checked.IsZero() && now.Sub(w.last.Checked) < every {
		return w.last
	}
	c := FileCheck{Path: w.path, Fingerprint: w.fingerprint, SHA256: w.full, Checked: now, Verified: w.last.Verified}
	c.Why = w.changed()
	if c.Why == "" {
		c.Why = w.fullChanged
	}
	c.Changed = c.Why != ""
	w.last = c
	return c
}

// changed says what changed in the file since it was loaded; "" when
// nothing did.
func (w *fileWatch) changed() string {
	fh, err := os.Open(w.path)
	if err != nil {
		return fmt.Sprintf("the file cannot be opened: %v", err)
	}
	defer fh.Close()
	info, err := fh.Stat()
	if err != nil {
		return fmt.Sprintf("the file cannot be read: %v", err)
	}
	switch {
	case !os.SameFile(info, w.info):
		return "another file is at its path (the weights served are the old file's until a restart)"
	case info.Size() != w.info.Size():
		return fmt.Sprintf("its size changed, from %d to %d bytes, under the running server", w.info.Size(), info.Size())
	case !info.ModTime().Equal(w.info.ModTime()):
		return fmt.Sprintf("it was written at %s, after the server loaded it", info.ModTime().UTC().Format(time.RFC3339))
	}
	fp, err := sampledHash(fh, info.Size(), w.dataOffset)
	if err != nil {
		return fmt.Sprintf("the file cannot be read: %v", err)
	}
	if fp != w.fingerprint {
		return fmt.Sprintf("its content changed under the running server (sampled hash %s, %s at load)", fp, w.fingerprint)
	}
	return ""
}
