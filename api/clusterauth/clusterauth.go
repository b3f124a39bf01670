// Package clusterauth is a PD cluster's shared secret and what each part
// of the PD plane derives from it.
//
// Threat model (docs/protocol.md, "Authentication"): an off-path attacker,
// anyone who can connect to a server's ports but can neither read nor
// alter the traffic between the cluster's servers. Every server of a
// cluster is given the same secret (--cluster-secret, PD_CLUSTER_SECRET or
// --cluster-secret-file; pdserve launch generates one for its children).
// The secret itself never goes on the wire: each use gets its own key,
// HMAC-SHA256(secret, purpose), so a credential seen or guessed for one
// use says nothing about another or about the secret.
//
//   - Signed HTTP requests (the router's PD requests to its servers, a
//     registration with the bootstrap registry): SignRequest, Verifier.
//     An HMAC of the method, path, time, a random nonce, the target (the
//     server the request is for, by the id it publishes) and the body
//     hash, accepted within MaxSkew of the receiver's clock, by the target
//     only, and once: a request sniffed on the way can be replayed
//     neither against another server nor against its own.
//   - ZeroMQ: a prefill rank's control socket (TRANSFER_INFO, ABORT,
//     heartbeats; a stranger who could send there could abort rooms or
//     redirect KV) runs CURVE with the keys CurveKeys derives: both ends
//     authenticated, every byte encrypted. A decode rank's KV socket runs
//     PLAIN with a rotating credential (KVCredential, KVAdmit): each
//     socket presents its own, derived from the secret and the time, good
//     for at most KVLifetime, so one sniffed on the wire is soon useless;
//     the KV bytes themselves cross in the clear (CURVE would cut their
//     throughput to about 0.15). A peer refused is never delivered.
package clusterauth

import (
	"crypto/ecdh"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// MinSecretBytes is the shortest secret accepted: 128 bits.
const MinSecretBytes = 16

// MaxSkew bounds how far a signed request's time may be from the
// receiver's clock (either way).
const MaxSkew = time.Minute

// Headers of a signed HTTP request.
const (
	HeaderTime      = "X-PD-Auth-Time"      // Unix seconds
	HeaderNonce     = "X-PD-Auth-Nonce"     // 128 random bits, hex
	HeaderSignature = "X-PD-Auth-Signature" // hex HMAC-SHA256
)

// Secret is a cluster's shared secret. The nil *Secret is "no secret":
// every method on it is defined (nothing signed, nothing derived).
type Secret struct {
	key []byte
}

// New makes a secret of text (at least MinSecretBytes bytes after
// trimming surrounding white space, which a file or an environment
// variable often adds).
func New(text string) (*Secret, error) {
	t := strings.TrimSpace(text)
	if len(t) < MinSecretBytes {
		return nil, fmt.Errorf("clusterauth: the cluster secret must be at least %d bytes, got %d", MinSecretBytes, len(t))
	}
	return &Secret{key: []byte(t)}, nil
}

// Load makes the secret from a value (a flag or PD_CLUSTER_SECRET) or a
// file, at most one of them set; nil with neither. A file must not be
// readable by other users.
func Load(value, file string) (*Secret, error) {
	switch {
	case value != "" && file != "":
		return nil, errors.New("clusterauth: give the cluster secret as a value or as a file, not both")
	case value != "":
		return New(value)
	case file != "":
		st, err := os.Stat(file)
		if err != nil {
			return nil, fmt.Errorf("clusterauth: cluster secret file: %w", err)
		}
		if st.Mode().Perm()&0o077 != 0 {
			return nil, fmt.Errorf("clusterauth: cluster secret file %s is readable by others (mode %v): chmod 600 it", file, st.Mode().Perm())
		}
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("clusterauth: cluster secret file: %w", err)
		}
		return New(string(b))
	}
	return nil, nil
}

// Generate makes a fresh random secret and returns it with its text.
func Generate() (*Secret, string) {
	b := make([]byte, 32)
	rand.Read(b) // never fails (crypto/rand panics on a broken source)
	text := hex.EncodeToString(b)
	return &Secret{key: []byte(text)}, text
}

// Set reports whether there is a secret.
func (s *Secret) Set() bool { return s != nil }

// derive is the key of one use of the secret.
func (s *Secret) derive(purpose string) []byte {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte("pdkit cluster key: " + purpose))
	return m.Sum(nil)
}

// CurveKeys derives the cluster's CURVE keypairs (raw 32-byte X25519
// keys): every control socket is a CURVE server with the server keypair
// and admits only the client public key, which every member presents.
// ok is false without a secret.
func (s *Secret) CurveKeys() (serverPublic, serverSecret, clientPublic, clientSecret string, ok bool) {
	if s == nil {
		return "", "", "", "", false
	}
	pair := func(label string) (string, string) {
		k, err := ecdh.X25519().NewPrivateKey(s.derive(label))
		if err != nil {
			panic(err) // cannot happen: any 32 bytes are an X25519 key
		}
		return string(k.PublicKey().Bytes()), string(k.Bytes())
	}
	serverPublic, serverSecret = pair("zmq curve server v1")
	clientPublic, clientSecret = pair("zmq curve client v1")
	return serverPublic, serverSecret, clientPublic, clientSecret, true
}

// KVEpoch is the period of the KV sockets' rotating credential: a socket
// presents the credential of the epoch it was made in and is made anew
// once it is older than KVEpoch and quiet; a receiver admits the
// credentials of the two epochs before now, now's and the next (clocks
// drift), so one is good for at most KVLifetime.
const (
	KVEpoch    = 10 * time.Minute
	KVLifetime = 3 * KVEpoch
)

// kvUserPrefix begins every KV credential's user name.
const kvUserPrefix = "pdkit-kv/"

// KVCredential is a fresh PLAIN credential for a KV socket made at now:
// the user name says the epoch and a random nonce (so that each socket's
// is its own), the password is the HMAC of the user name. Empty without a
// secret.
func (s *Secret) KVCredential(now time.Time) (user, password string) {
	if s == nil {
		return "", ""
	}
	nonce := make([]byte, 8)
	rand.Read(nonce)
	user = fmt.Sprintf("%s%d/%x", kvUserPrefix, now.Unix()/int64(KVEpoch/time.Second), nonce)
	return user, hex.EncodeToString(s.kvPassword(user))
}

func (s *Secret) kvPassword(user string) []byte {
	m := hmac.New(sha256.New, s.derive("zmq kv v1"))
	m.Write([]byte(user))
	return m.Sum(nil)
}

// KVAdmit reports whether user and password are a KV credential of this
// secret still good at now (see KVEpoch).
func (s *Secret) KVAdmit(user, password []byte, now time.Time) bool {
	if s == nil {
		return false
	}
	rest, ok := strings.CutPrefix(string(user), kvUserPrefix)
	if !ok {
		return false
	}
	es, _, ok := strings.Cut(rest, "/")
	epoch, err := strconv.ParseInt(es, 10, 64)
	if !ok || err != nil {
		return false
	}
	cur := now.Unix() / int64(KVEpoch/time.Second)
	if epoch < cur-2 || epoch > cur+1 {
		return false
	}
	got, err := hex.DecodeString(string(password))
	return err == nil && hmac.Equal(got, s.kvPassword(string(user)))
}

// AdminToken is the bearer token of the servers' admin API that the
// secret derives (hex, 64 characters); "" without a secret. A server with
// a secret and no --admin-token of its own takes it, so whoever holds the
// secret (pdctl with --cluster-secret-file) can make admin calls, and no
// one else, loopback or not.
func (s *Secret) AdminToken() string {
	if s == nil {
		return ""
	}
	return hex.EncodeToString(s.derive("admin bearer v1"))
}

// signature is the HMAC of a request's method, path, time, nonce, target
// and body.
func (s *Secret) signature(method, path string, unix int64, nonce, target string, body []byte) []byte {
	h := sha256.Sum256(body)
	m := hmac.New(sha256.New, s.derive("signed http v2"))
	fmt.Fprintf(m, "%s\n%s\n%d\n%s\n%s\n%x", method, path, unix, nonce, target, h)
	return m.Sum(nil)
}

// SignRequest signs r, whose body is body, at now, for target: the id of
// the server it is for (its ServerInfo.ID; a Verifier for another id
// refuses it). Without a secret it does nothing.
func (s *Secret) SignRequest(r *http.Request, body []byte, now time.Time, target string) {
	if s == nil {
		return
	}
	unix := now.Unix()
	nonce := make([]byte, 16)
	rand.Read(nonce)
	n := hex.EncodeToString(nonce)
	r.Header.Set(HeaderTime, strconv.FormatInt(unix, 10))
	r.Header.Set(HeaderNonce, n)
	r.Header.Set(HeaderSignature, hex.EncodeToString(s.signature(r.Method, r.URL.Path, unix, n, target, body)))
}

// Errors of Verifier.Verify.
var (
	ErrUnsigned     = errors.New("the request is not signed with the cluster secret")
	ErrBadSignature = errors.New("the request's signature does not match the cluster secret, or it was signed for another server")
	ErrStale        = errors.New("the request's signing time is too far from this server's clock")
	ErrReplayed     = errors.New("the request was received before: a signed request is good once")
)

// MaxRemembered bounds the signatures a Verifier remembers (about 40 bytes
// each): within MaxSkew either way, more than about 2,000 signed requests a
// second to one server. Past it the oldest is forgotten first, and the
// request it signed could be received once more within its window.
const MaxRemembered = 1 << 18

// Verifier checks the signed requests a server receives: signed with the
// cluster secret, for this server (Self), within MaxSkew, and never
// before. Safe for concurrent use.
type Verifier struct {
	Secret *Secret
	// Self is this server's id, the target its requests are signed for.
	Self string

	mu   sync.Mutex
	seen map[[16]byte]time.Time // signature prefix -> when it can be forgotten
	ring [][16]byte             // seen's keys, oldest first
	head int
	// forgotten counts signatures forgotten for room before their window
	// ended.
	forgotten uint64
}

// Verify checks r, whose body is body, at now (the receiver's clock). It
// is an error without a secret: nothing can be verified then.
func (v *Verifier) Verify(r *http.Request, body []byte, now time.Time) error {
	s := v.Secret
	if s == nil {
		return errors.New("clusterauth: no cluster secret to verify with")
	}
	ts, nonce, sig := r.Header.Get(HeaderTime), r.Header.Get(HeaderNonce), r.Header.Get(HeaderSignature)
	if ts == "" || sig == "" || nonce == "" {
		return ErrUnsigned
	}
	unix, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return ErrUnsigned
	}
	at := time.Unix(unix, 0)
	if d := now.Sub(at); d > MaxSkew || d < -MaxSkew {
		return ErrStale
	}
	got, err := hex.DecodeString(sig)
	if err != nil || !hmac.Equal(got, s.signature(r.Method, r.URL.Path, unix, nonce, v.Self, body)) {
		return ErrBadSignature
	}
	if !v.once([16]byte(got[:16]), at.Add(MaxSkew+time.Second), now) {
		return ErrReplayed
	}
	return nil
}

// once records a signature good until until, and reports whether it was
// new.
func (v *Verifier) once(key [16]byte, until, now time.Time) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.seen == nil {
		v.seen = map[[16]byte]time.Time{}
	}
	if t, ok := v.seen[key]; ok && now.Before(t) {
		return false
	}
	// Forget what has expired, oldest first; and, at the bound, the
	// oldest regardless.
	for v.head < len(v.ring) {
		old := v.ring[v.head]
		expired := !now.Before(v.seen[old])
		if !expired && len(v.seen) < MaxRemembered {
			break
		}
		if !expired {
			v.forgotten++
		}
		delete(v.seen, old)
		v.head++
	}
	if v.head > 1024 && 2*v.head > len(v.ring) {
		v.ring, v.head = append(v.ring[:0], v.ring[v.head:]...), 0
	}
	v.seen[key] = until
	v.ring = append(v.ring, key)
	return true
}

// Forgotten counts the signatures forgotten at MaxRemembered before their
// window had ended.
func (v *Verifier) Forgotten() uint64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.forgotten
}
