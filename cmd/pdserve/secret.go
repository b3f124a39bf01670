package main

import (
	"log/slog"
	"net"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/engine/pd/bootstrap"
)

// secretFlags are the cluster secret's flags, on every PD role.
type secretFlags struct {
	value, file string
}

func (s *secretFlags) register(f *pflag.FlagSet) {
	f.StringVar(&s.value, "cluster-secret", "", "the PD cluster's shared secret (at least 16 bytes; prefer PD_CLUSTER_SECRET or --cluster-secret-file): "+
		"PD sockets admit only peers holding it and the bootstrap registry takes only registrations signed with it; "+
		"required unless every address is loopback")
	f.StringVar(&s.file, "cluster-secret-file", "", "file holding the cluster secret (mode 600)")
}

// load reads the secret. Without one, a server whose addresses (hosts)
// are all loopback runs with an open PD plane, said once in the log;
// any other is refused: strangers could reach its PD plane.
func (s secretFlags) load(log *slog.Logger, hosts ...string) (*clusterauth.Secret, error) {
	secret, err := clusterauth.Load(s.value, s.file)
	if err != nil {
		return nil, usageError{err}
	}
	if secret.Set() {
		return secret, nil
	}
	for _, h := range hosts {
		if !loopbackHost(h) {
			return nil, usagef("--cluster-secret (or PD_CLUSTER_SECRET, --cluster-secret-file) is required: %s is not a loopback address, "+
				"and without a secret any host that reaches the PD ports could steer the cluster", h)
		}
	}
	log.Warn("no cluster secret: the PD plane admits any local peer (allowed because every address is loopback)")
	return nil, nil
}

// loopbackHost reports whether h names a loopback address.
func loopbackHost(h string) bool {
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// watchRegistry puts the registry's refusals on /metrics.
func watchRegistry(reg prometheus.Registerer, g *bootstrap.Registry) error {
	for _, c := range []struct {
		reason string
		count  func(bootstrap.Stats) uint64
	}{
		{"unauthenticated", func(s bootstrap.Stats) uint64 { return s.Unauthenticated }},
		{"future_start", func(s bootstrap.Stats) uint64 { return s.FutureStart }},
	} {
		err := reg.Register(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "pdkit_bootstrap_registrations_refused_total",
			Help:        "Registrations the bootstrap registry refused, by reason: unauthenticated (not signed with the cluster secret), future_start (started_at ahead of its clock).",
			ConstLabels: prometheus.Labels{"reason": c.reason},
		}, func() float64 { return float64(c.count(g.Stats())) }))
		if err != nil {
			return err
		}
	}
	return nil
}
