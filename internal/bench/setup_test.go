package bench

import (
	"testing"
	"time"
)

// TestSetDefault: an unset field (zero, or a negative number) takes the
// default; a set one keeps its value.
func TestSetDefault(t *testing.T) {
	s, set := "", "tiny"
	n, neg, pos := 0, -1, 3
	var u uint64
	d := time.Second
	setDefault(&s, "small")
	setDefault(&set, "small")
	setDefault(&n, 8)
	setDefault(&neg, 8)
	setDefault(&pos, 8)
	setDefault(&u, 1)
	setDefault(&d, time.Minute)
	if s != "small" || set != "tiny" || n != 8 || neg != 8 || pos != 3 || u != 1 || d != time.Second {
		t.Errorf("got %q %q %d %d %d %d %v, want small tiny 8 8 3 1 1s", s, set, n, neg, pos, u, d)
	}
}
