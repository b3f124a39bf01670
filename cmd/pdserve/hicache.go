package main

import (
	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/engine/prefix"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/config"
)

// hicacheFlags are the host tier's flags, shared by the engine roles and
// launch (which hands them to its servers).
type hicacheFlags struct {
	on        bool
	size      config.Bytes
	ratio     float64
	policy    string
	bandwidth config.Rate
}

// hicacheFlagNames are the flags register adds, in its order.
var hicacheFlagNames = []string{"hicache", "hicache-size", "hicache-ratio", "hicache-write-policy", "hicache-load-bandwidth"}

func (h *hicacheFlags) register(f *pflag.FlagSet) {
	def := serve.DefaultConfig().HiCache
	f.BoolVar(&h.on, "hicache", def.Enabled, "give each rank's prefix cache a host-memory tier (HiCache): prefix pages are backed up to host memory and loaded back layer by layer; needs the prefix cache, and a decode server refuses it (it keeps no host tier: its prompts' KV comes from the prefill); switch it live: POST /admin/v1/hicache/on|off")
	h.size = config.Bytes(def.Bytes)
	f.Var(&h.size, "hicache-size", "host tier size per rank, e.g. 512MiB, 2GiB or plain bytes (0: --hicache-ratio × the device KV pool); refused beyond the memory available")
	f.Float64Var(&h.ratio, "hicache-ratio", def.Ratio, "host tier size as a multiple of each rank's device KV pool, when --hicache-size is 0")
	f.StringVar(&h.policy, "hicache-write-policy", def.Policy.String(), "when prefix pages are backed up to host, SGLang's three policies: write-through (as soon as a finished request's pages are cached), write-through-selective (once a cached prefix is reused) or write-back (when the device evicts it)")
	h.bandwidth = config.Rate(def.LoadBandwidth)
	f.Var(&h.bandwidth, "hicache-load-bandwidth", "pace each rank's loads back from host, bytes per second, e.g. 2GB/s or 500MiB/s (0: unlimited; settable live: POST /admin/v1/hicache/bandwidth)")
}

// config parses the flags and returns the engine's host tier settings, as
// the engine's own rules check them (serve.HiCacheConfig.Validate).
// noPrefixCache is --no-prefix-cache, which the tier cannot go without. A
// ratio of 0 is refused here, where it is a value the user typed: in the
// engine's configuration 0 stands for the default.
func (h *hicacheFlags) config(noPrefixCache bool) (serve.HiCacheConfig, error) {
	if !(h.ratio > 0) {
		return serve.HiCacheConfig{}, usagef("--hicache-ratio %v: want a positive multiple of the device KV pool", h.ratio)
	}
	p, err := prefix.ParsePolicy(h.policy)
	if err != nil {
		return serve.HiCacheConfig{}, usagef("--hicache-write-policy %q: want %s", h.policy, prefix.PolicyNames())
	}
	c := serve.HiCacheConfig{Enabled: h.on, Bytes: int64(h.size), Ratio: h.ratio, Policy: p, LoadBandwidth: int64(h.bandwidth)}
	if err := c.Validate(noPrefixCache); err != nil {
		return serve.HiCacheConfig{}, usageError{err}
	}
	return c, nil
}

// args are the flags set (on the command line or by their PD_* variable)
// of fs, as arguments that give a server the same values: launch passes
// them on, since it keeps its own PD_* variables from its servers.
func hicacheArgs(fs *pflag.FlagSet) []string {
	var args []string
	for _, e := range config.Effective(fs) {
		for _, name := range hicacheFlagNames {
			if e.Name == name && e.Source != "default" {
				args = append(args, "--"+name+"="+e.Value)
			}
		}
	}
	return args
}
