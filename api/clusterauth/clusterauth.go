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
//   - The bootstrap registry: a registration over HTTP is signed
//     (SignRequest, VerifyRequest): an HMAC of the method, path, time and
//     body hash, accepted within MaxSkew of the receiver's clock.
//   - ZeroMQ: every PD socket authenticates its peers with the PLAIN
//     mechanism and a ZAP handler that admits only the credential ZMQ
//     derives; a peer without it is never delivered.
package clusterauth

import (
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
	HeaderSignature = "X-PD-Auth-Signature" // hex HMAC-SHA256
)

// ZMQUser is the PLAIN user name every cluster member presents.
const ZMQUser = "pdkit"

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

// ZMQ is the PLAIN credential of the cluster's ZeroMQ sockets; ok is false
// without a secret.
func (s *Secret) ZMQ() (user, password string, ok bool) {
	if s == nil {
		return "", "", false
	}
	return ZMQUser, hex.EncodeToString(s.derive("zmq plain v1")), true
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

// signature is the HMAC of a request's method, path, time and body.
func (s *Secret) signature(method, path string, unix int64, body []byte) []byte {
	h := sha256.Sum256(body)
	m := hmac.New(sha256.New, s.derive("registry http v1"))
	fmt.Fprintf(m, "%s\n%s\n%d\n%x", method, path, unix, h)
	return m.Sum(nil)
}

// SignRequest signs r, whose body is body, at now. Without a secret it
// does nothing.
func (s *Secret) SignRequest(r *http.Request, body []byte, now time.Time) {
	if s == nil {
		return
	}
	unix := now.Unix()
	r.Header.Set(HeaderTime, strconv.FormatInt(unix, 10))
	r.Header.Set(HeaderSignature, hex.EncodeToString(s.signature(r.Method, r.URL.Path, unix, body)))
}

// Errors of VerifyRequest.
var (
	ErrUnsigned     = errors.New("the request is not signed with the cluster secret")
	ErrBadSignature = errors.New("the request's signature does not match the cluster secret")
	ErrStale        = errors.New("the request's signing time is too far from this server's clock")
)

// VerifyRequest checks r's signature over body at now (the receiver's
// clock). It is an error without a secret: nothing can be verified then.
func (s *Secret) VerifyRequest(r *http.Request, body []byte, now time.Time) error {
	if s == nil {
		return errors.New("clusterauth: no cluster secret to verify with")
	}
	ts, sig := r.Header.Get(HeaderTime), r.Header.Get(HeaderSignature)
	if ts == "" || sig == "" {
		return ErrUnsigned
	}
	unix, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return ErrUnsigned
	}
	if d := now.Sub(time.Unix(unix, 0)); d > MaxSkew || d < -MaxSkew {
		return ErrStale
	}
	got, err := hex.DecodeString(sig)
	if err != nil || !hmac.Equal(got, s.signature(r.Method, r.URL.Path, unix, body)) {
		return ErrBadSignature
	}
	return nil
}
