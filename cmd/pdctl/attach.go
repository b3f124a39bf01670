package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/zmtp"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/spf13/cobra"
)

// defaultRouter is where pdctl looks for the router without --router or
// PDCTL_ROUTER.
const defaultRouter = "http://127.0.0.1:8000"

// attachOptions are the global flags that say which cluster to talk to.
type attachOptions struct {
	Router  string   // --router, PDCTL_ROUTER
	Servers []string // --server, repeatable: skip discovery
	Token   string   // --token, PDCTL_TOKEN
	// Secret and SecretFile are the cluster secret (--cluster-secret,
	// PD_CLUSTER_SECRET; --cluster-secret-file, PD_CLUSTER_SECRET_FILE),
	// for the PD frames pdctl sends itself.
	Secret, SecretFile string
	HTTP               *http.Client
}

func addAttachFlags(cmd *cobra.Command, f *factory, o *attachOptions) {
	router := f.getenv("PDCTL_ROUTER")
	if router == "" {
		router = defaultRouter
	}
	fl := cmd.PersistentFlags()
	fl.StringVar(&o.Router, "router", router, "the router whose servers to discover (env PDCTL_ROUTER)")
	fl.StringArrayVar(&o.Servers, "server", nil, "address this server directly, skipping discovery (repeatable)")
	fl.StringVar(&o.Token, "token", "", "bearer token for the admin calls (env PDCTL_TOKEN; default: the one the cluster secret derives, which servers with a secret and no --admin-token take)")
	fl.StringVar(&o.Secret, "cluster-secret", "", "the PD cluster's shared secret, for the PD frames pdctl sends itself and the admin calls (env PD_CLUSTER_SECRET)")
	fl.StringVar(&o.SecretFile, "cluster-secret-file", "", "file holding the cluster secret, mode 600 (env PD_CLUSTER_SECRET_FILE; pdserve launch prints its own)")
}

// pdAuth is what pdctl needs of the cluster secret on the PD plane, from
// the flags or the environment: the CURVE keys it dials a prefill rank's
// control socket with, and the rule its own PULL socket admits the
// ranks' acks by (the rotating credential of the KV sockets, which a
// prefill rank's outbox presents). Both nil without a secret.
func (o *attachOptions) pdAuth(f *factory) (*zmtp.CurveAuth, *zmtp.PlainAuth, error) {
	secret, err := o.secret(f)
	if err != nil {
		return nil, nil, err
	}
	sp, _, cp, cs, ok := secret.CurveKeys()
	if !ok {
		return nil, nil, nil
	}
	curve := &zmtp.CurveAuth{ServerPublic: [32]byte([]byte(sp)), ClientPublic: [32]byte([]byte(cp)), ClientSecret: [32]byte([]byte(cs))}
	acks := &zmtp.PlainAuth{Admit: func(user, password []byte) bool { return secret.KVAdmit(user, password, time.Now()) }}
	return curve, acks, nil
}

// token is --token, else PDCTL_TOKEN, else the admin token the cluster
// secret derives (the servers of a cluster with a secret and no
// --admin-token take it); "" without any.
func (o *attachOptions) token(f *factory) string {
	if o.Token != "" {
		return o.Token
	}
	if t := f.getenv("PDCTL_TOKEN"); t != "" {
		return t
	}
	secret, err := o.secret(f)
	if err != nil {
		return "" // the PD frames report a secret that does not load
	}
	return secret.AdminToken()
}

// secret is the cluster secret from the flags or the environment; nil
// without one.
func (o *attachOptions) secret(f *factory) (*clusterauth.Secret, error) {
	value, file := o.Secret, o.SecretFile
	if value == "" && file == "" {
		value, file = f.getenv("PD_CLUSTER_SECRET"), f.getenv("PD_CLUSTER_SECRET_FILE")
	}
	return clusterauth.Load(value, file)
}

// routerClient is a client of the router the servers were discovered
// through; nil when they were named with --server.
func (o *attachOptions) routerClient(f *factory) *client.Client {
	if len(o.Servers) > 0 {
		return nil
	}
	return client.New(o.Router, o.token(f), o.HTTP)
}

// target is one server pdctl talks to.
type target struct {
	URL     string
	Role    string
	TPSize  int
	Model   string
	Healthy bool
	Reason  string // why not healthy
	Err     error  // the server could not be reached
	c       *client.Client
}

// unreachableError reports, after the output, that some servers could not
// be reached: the command ran and its output says which (exit findings).
type unreachableError struct{ n, of int }

func (e *unreachableError) Error() string {
	if e.of == 1 {
		return "the server is unreachable"
	}
	return pluralf(e.n, "server", "servers") + " of " + itoa(e.of) + " unreachable"
}

// targets resolves the servers: the --server list (each asked for its
// /pd/v1/info and /health), else the router's cluster list. A router that
// cannot be reached is an error; a server that cannot be reached is a
// target with Err set.
func (o *attachOptions) targets(ctx context.Context, f *factory) ([]*target, error) {
	tok := o.token(f)
	if len(o.Servers) == 0 {
		servers, err := client.Discover(ctx, o.Router, tok, o.HTTP)
		if err != nil {
			return nil, err
		}
		if len(servers) == 0 {
			return nil, errors.New("the router at " + o.Router + " lists no servers")
		}
		saveDiscovery(f, o.Router, servers, time.Now())
		return o.clusterTargets(f, servers), nil
	}
	out := make([]*target, len(o.Servers))
	var wg sync.WaitGroup
	for i, u := range o.Servers {
		t := &target{URL: u, c: client.New(u, tok, o.HTTP)}
		out[i] = t
		wg.Go(func() {
			info, err := t.c.Info(ctx)
			if err != nil {
				t.Err = err
				return
			}
			t.Role, t.TPSize, t.Model = info.Role, info.TPSize, info.Model
			switch err := t.c.Health(ctx); {
			case err == nil:
				t.Healthy = true
			case client.StatusOf(err) != 0:
				var ae *client.APIError
				errors.As(err, &ae)
				t.Reason = ae.Message
			default:
				t.Err = err
			}
		})
	}
	wg.Wait()
	return out, nil
}

// clusterTargets are the targets of the servers a router listed.
func (o *attachOptions) clusterTargets(f *factory, servers []debug.ClusterServer) []*target {
	tok := o.token(f)
	out := make([]*target, len(servers))
	for i, s := range servers {
		out[i] = &target{URL: s.URL, Role: s.Role, TPSize: s.TPSize, Model: s.Model,
			Healthy: s.Healthy, Reason: s.Reason, c: client.New(s.URL, tok, o.HTTP)}
	}
	return out
}

// isPD says whether a server of role has PD queues.
func isPD(role string) bool { return role == pdproto.RolePrefill || role == pdproto.RoleDecode }

func errorsAs(err error, target any) bool { return errors.As(err, target) }

func errorf(format string, a ...any) error { return fmt.Errorf(format, a...) }
