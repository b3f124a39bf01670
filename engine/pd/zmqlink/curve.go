package zmqlink

import (
	"bytes"
	"crypto/ecdh"
	"crypto/sha256"
	"fmt"
)

// CURVE, measured beside PLAIN in the benchmarks (bench_test.go) and not
// offered to callers: it authenticates and encrypts every byte, which the
// KV path cannot afford (see doc.go). The keys are derived from one
// seed, so both ends agree without exchanging them: every server shares
// one keypair and every client another.

// curveKeys are the raw 32-byte CURVE keys of one cluster.
type curveKeys struct {
	serverPublic, serverSecret string
	clientPublic, clientSecret string
}

// curveKeysFrom derives the server and client keypairs from seed.
func curveKeysFrom(seed string) (*curveKeys, error) {
	sp, ss, err := curveKeypair(seed + "/server")
	if err != nil {
		return nil, err
	}
	cp, cs, err := curveKeypair(seed + "/client")
	if err != nil {
		return nil, err
	}
	return &curveKeys{serverPublic: sp, serverSecret: ss, clientPublic: cp, clientSecret: cs}, nil
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
func (k *curveKeys) apply(s zSocket, server bool) error {
	if server {
		if err := setOpts(s, []sockOpt{optZapDomain, optCurveSecretKey}, []string{zapDomain, k.serverSecret}); err != nil {
			return err
		}
		if err := s.setOpt(optCurveServer, 1); err != nil {
			return err
		}
		return s.monitor(monitorEndpoint, authEvents)
	}
	return setOpts(s, []sockOpt{optCurveServerKey, optCurvePublicKey, optCurveSecretKey},
		[]string{k.serverPublic, k.clientPublic, k.clientSecret})
}

// admit admits the client public key.
func (k *curveKeys) admit() admitFunc {
	want := []byte(k.clientPublic)
	return func(mech string, creds [][]byte) bool {
		return mech == "CURVE" && len(creds) == 1 && bytes.Equal(creds[0], want)
	}
}
