package clusterauth

import (
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestSignVerify(t *testing.T) {
	s, _ := Generate()
	other, _ := Generate()
	now := time.Unix(1_800_000_000, 0)
	body := []byte(`{"rank":0}`)
	req := func() *http.Request {
		r, _ := http.NewRequest(http.MethodPut, "http://x/bootstrap/v1/ranks/0", nil)
		return r
	}
	r := req()
	s.SignRequest(r, body, now)
	if err := s.VerifyRequest(r, body, now.Add(30*time.Second)); err != nil {
		t.Fatalf("a signed request: %v", err)
	}
	cases := []struct {
		name string
		mod  func(r *http.Request) ([]byte, time.Time)
		want error
	}{
		{"unsigned", func(r *http.Request) ([]byte, time.Time) {
			r.Header.Del(HeaderSignature)
			return body, now
		}, ErrUnsigned},
		{"another body", func(r *http.Request) ([]byte, time.Time) { return []byte(`{"rank":1}`), now }, ErrBadSignature},
		{"another path", func(r *http.Request) ([]byte, time.Time) {
			r.URL.Path = "/bootstrap/v1/ranks/1"
			return body, now
		}, ErrBadSignature},
		{"stale", func(r *http.Request) ([]byte, time.Time) { return body, now.Add(2 * MaxSkew) }, ErrStale},
		{"from the future", func(r *http.Request) ([]byte, time.Time) { return body, now.Add(-2 * MaxSkew) }, ErrStale},
	}
	for _, c := range cases {
		r := req()
		s.SignRequest(r, body, now)
		b, at := c.mod(r)
		if err := s.VerifyRequest(r, b, at); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	r = req()
	other.SignRequest(r, body, now)
	if err := s.VerifyRequest(r, body, now); !errors.Is(err, ErrBadSignature) {
		t.Errorf("signed with another secret: %v", err)
	}
}

func TestDerivedKeysDiffer(t *testing.T) {
	a, _ := New("0123456789abcdef-a")
	b, _ := New("0123456789abcdef-b")
	ua, pa, _ := a.ZMQ()
	_, pb, _ := b.ZMQ()
	if ua != ZMQUser || pa == pb || len(pa) != 64 || strings.Contains(pa, "0123456789abcdef") {
		t.Fatalf("ZMQ credentials %q %q", pa, pb)
	}
	var none *Secret
	if _, _, ok := none.ZMQ(); ok || none.Set() {
		t.Fatal("the nil secret derives a credential")
	}
}

func TestLoad(t *testing.T) {
	if s, err := Load("", ""); s != nil || err != nil {
		t.Fatalf("nothing given: %v %v", s, err)
	}
	if _, err := Load("short", ""); err == nil {
		t.Fatal("a short secret was accepted")
	}
	dir := t.TempDir()
	f := filepath.Join(dir, "secret")
	if err := os.WriteFile(f, []byte("0123456789abcdef0123\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load("", f); err == nil || !strings.Contains(err.Error(), "readable by others") {
		t.Fatalf("a world-readable file: %v", err)
	}
	os.Chmod(f, 0o600)
	s, err := Load("", f)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := Load("0123456789abcdef0123", "")
	_, p1, _ := s.ZMQ()
	_, p2, _ := v.ZMQ()
	if p1 != p2 {
		t.Fatal("the file's trailing newline changed the secret")
	}
	if _, err := Load("0123456789abcdef0123", f); err == nil {
		t.Fatal("a value and a file were both accepted")
	}
}
