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
	v := &Verifier{Secret: s, Self: "srv-a"}
	r := req()
	s.SignRequest(r, body, now, "srv-a")
	if err := v.Verify(r, body, now.Add(30*time.Second)); err != nil {
		t.Fatalf("a signed request: %v", err)
	}
	if err := v.Verify(r, body, now.Add(31*time.Second)); !errors.Is(err, ErrReplayed) {
		t.Fatalf("the same request again: %v, want %v", err, ErrReplayed)
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
		{"without its nonce", func(r *http.Request) ([]byte, time.Time) {
			r.Header.Del(HeaderNonce)
			return body, now
		}, ErrUnsigned},
		{"another nonce", func(r *http.Request) ([]byte, time.Time) {
			r.Header.Set(HeaderNonce, "00")
			return body, now
		}, ErrBadSignature},
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
		s.SignRequest(r, body, now, "srv-a")
		b, at := c.mod(r)
		if err := v.Verify(r, b, at); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	r = req()
	other.SignRequest(r, body, now, "srv-a")
	if err := v.Verify(r, body, now); !errors.Is(err, ErrBadSignature) {
		t.Errorf("signed with another secret: %v", err)
	}
	// Signed for another server: refused by this one, taken by that one.
	r = req()
	s.SignRequest(r, body, now, "srv-b")
	if err := v.Verify(r, body, now); !errors.Is(err, ErrBadSignature) {
		t.Errorf("signed for another server: %v", err)
	}
	if err := (&Verifier{Secret: s, Self: "srv-b"}).Verify(r, body, now); err != nil {
		t.Errorf("at the server it was signed for: %v", err)
	}
}

// A verifier remembers a signature for its whole window and forgets it
// after; at MaxRemembered it forgets the oldest first, and counts that.
func TestVerifierRemembers(t *testing.T) {
	v := &Verifier{}
	now := time.Unix(1_800_000_000, 0)
	key := func(i int) [16]byte { return [16]byte{byte(i), byte(i >> 8), byte(i >> 16), byte(i >> 24)} }
	if !v.once(key(1), now.Add(MaxSkew), now) || v.once(key(1), now.Add(MaxSkew), now.Add(MaxSkew-time.Second)) {
		t.Fatal("a signature taken twice within its window")
	}
	if !v.once(key(1), now.Add(3*MaxSkew), now.Add(MaxSkew)) {
		t.Fatal("a signature refused after its window")
	}
	for i := range MaxRemembered + 10 {
		v.once(key(100+i), now.Add(time.Hour), now.Add(2*MaxSkew))
	}
	if len(v.seen) > MaxRemembered || v.Forgotten() == 0 {
		t.Fatalf("%d remembered (bound %d), %d forgotten", len(v.seen), MaxRemembered, v.Forgotten())
	}
	if v.once(key(100+MaxRemembered+9), now.Add(time.Hour), now.Add(2*MaxSkew)) {
		t.Fatal("the newest signature forgotten")
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
