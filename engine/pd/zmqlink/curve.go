package zmqlink

import (
	"bytes"
	"crypto/ecdh"
	"crypto/sha256"
	"fmt"
)

// CURVE (SocketOptions.Curve): ZeroMQ's CurveZMQ mechanism, which
// authenticates both ends and encrypts every byte. pdkit uses it on the
// control sockets, whose small messages can afford it; the KV path cannot
// (0.15 of its throughput, doc.go) and uses RotatingAuth instead. The keys
// are derived from one seed (the cluster secret's), so both ends agree
// without exchanging them: every server shares one keypair and every
// client another, and an Inbox admits only the client public key.

// CurveKeys are the raw 32-byte CURVE keys of one cluster: an Inbox is a
// CURVE server with the server keypair and admits only ClientPublic; an
// Outbox presents the client keypair and expects ServerPublic.
type CurveKeys struct {
	ServerPublic, ServerSecret string
	ClientPublic, ClientSecret string
}

func (k *CurveKeys) validate() error {
	for _, v := range []string{k.ServerPublic, k.ServerSecret, k.ClientPublic, k.ClientSecret} {
		if len(v) != 32 {
			return fmt.Errorf("zmqlink: curve: a key of %d bytes, want 32", len(v))
		}
	}
	return nil
}

// CurveKeysFrom derives the server and client keypairs from seed.
func CurveKeysFrom(seed string) (*CurveKeys, error) {
	sp, ss, err := curveKeypair(seed + "/server")
	if err != nil {
		return nil, err
	}
	cp, cs, err := curveKeypair(seed + "/client")
	if err != nil {
		return nil, err
	}
	return &CurveKeys{ServerPublic: sp, ServerSecret: ss, ClientPublic: cp, ClientSecret: cs}, nil
}

// curveKeypair derives one X25519 keypair (CURVE's keys) from label.
func curveKeypair(label string) (public, secret string, err error) {
	sum := sha256.Sum256([]byte(label))
	k, err := ecdh.X25519().NewPrivateKey(sum[:])
	if err != nil {
		return "", "", fmt.Errorf("zmqlink: curve key: %w", err)
	}
	return string(k.PublicKey().Bytes()), string(k.Bytes()), nil
}

// apply makes s a CURVE server with the server keypair, or a client that
// presents the client keypair and expects the server's public key.
func (k *CurveKeys) apply(s zSocket, server bool) error {
	if server {
		if err := setOpts(s, []sockOpt{optZapDomain, optCurveSecretKey}, []string{zapDomain, k.ServerSecret}); err != nil {
			return err
		}
		if err := s.setOpt(optCurveServer, 1); err != nil {
			return err
		}
		return s.monitor(monitorEndpoint, authEvents)
	}
	return setOpts(s, []sockOpt{optCurveServerKey, optCurvePublicKey, optCurveSecretKey},
		[]string{k.ServerPublic, k.ClientPublic, k.ClientSecret})
}

// admit admits the client public key.
func (k *CurveKeys) admit() admitFunc {
	want := []byte(k.ClientPublic)
	return func(mech string, creds [][]byte) bool {
		return mech == "CURVE" && len(creds) == 1 && bytes.Equal(creds[0], want)
	}
}
