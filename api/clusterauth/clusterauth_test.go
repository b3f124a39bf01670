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
	_, _, _, pa, _ := a.CurveKeys()
	_, _, _, pb, _ := b.CurveKeys()
	if pa == pb || len(pa) != 32 || strings.Contains(pa, "0123456789abcdef") {
		t.Fatalf("CURVE client secret keys %x %x", pa, pb)
	}
	if a.AdminToken() == b.AdminToken() || strings.Contains(a.AdminToken(), "0123456789abcdef") {
		t.Fatal("the admin tokens of two secrets")
	}
	var none *Secret
	if _, _, _, _, ok := none.CurveKeys(); ok || none.Set() {
		t.Fatal("the nil secret derives keys")
	}
}

// A KV credential is its own per call, admitted by its secret only and
// within its lifetime only.
func TestKVCredential(t *testing.T) {
	s, _ := Generate()
	other, _ := Generate()
	now := time.Unix(1_800_000_000, 0)
	u1, p1 := s.KVCredential(now)
	u2, p2 := s.KVCredential(now)
	if u1 == u2 || p1 == p2 {
		t.Fatal("two calls made the same credential")
	}
	for _, c := range []struct {
		name     string
		s        *Secret
		u, p     string
		at       time.Time
		admitted bool
	}{
		{"fresh", s, u1, p1, now, true},
		{"an epoch on (the socket lives one more)", s, u1, p1, now.Add(KVEpoch), true},
		{"two epochs on (a reconnect's margin)", s, u1, p1, now.Add(2 * KVEpoch), true},
		{"past its lifetime", s, u1, p1, now.Add(KVLifetime), false},
		{"from a clock an epoch behind", s, u1, p1, now.Add(-KVEpoch), true},
		{"from a clock two epochs behind", s, u1, p1, now.Add(-2 * KVEpoch), false},
		{"another secret", other, u1, p1, now, false},
		{"another user", s, u2, p1, now, false},
		{"the epoch changed", s, strings.Replace(u1, "/3000000/", "/3000001/", 1), p1, now, false},
		{"not a KV user", s, "pdkit", p1, now, false},
	} {
		if got := c.s.KVAdmit([]byte(c.u), []byte(c.p), c.at); got != c.admitted {
			t.Errorf("%s: admitted %v, want %v", c.name, got, c.admitted)
		}
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
	if s.AdminToken() != v.AdminToken() {
		t.Fatal("the file's trailing newline changed the secret")
	}
	if _, err := Load("0123456789abcdef0123", f); err == nil {
		t.Fatal("a value and a file were both accepted")
	}
}
