package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/pdkit/pdkit/api/clusterauth"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/config"
	"github.com/pdkit/pdkit/internal/launch"
)

// launchExecutable is the program every server runs (tests replace it).
var launchExecutable = os.Executable

type launchOptions struct {
	model        string
	port         int
	prefill      int
	decode       int
	tp           int
	faults       []string
	hicache      hicacheFlags
	kvDType      string
	kvMemory     config.Budget
	readyTimeout time.Duration
	grace        time.Duration
}

func newLaunchCmd() *cobra.Command {
	o := launchOptions{}
	cmd := &cobra.Command{
		Use:   "launch [--model FILE] [--port 8000] [--prefill N] [--decode N] [--tp N] [--kv-dtype f32|bf16|f16] [--fault NAME]... [--hicache]",
		Short: "Run a PD cluster on this machine: a router, prefill and decode servers as child processes on loopback",
		Long: `Run a PD cluster on this machine: N prefill and M decode servers and a router
in front of them, each a child process of this one listening on 127.0.0.1
(free ports, the router on --port). Once every server answers /health it
prints the endpoints. Ctrl-C or SIGTERM stops them all; when one of them
dies, the others are stopped too and launch exits 1, quoting its last output.
--kv-dtype goes to every prefill and decode server (prefills and decodes
must store KV alike), the --hicache flags to the prefill servers (a decode
server keeps no host tier). Other PD_*
variables in the environment reach the servers. The servers and the router
share a cluster secret (the router signs its requests to the servers with it): PD_CLUSTER_SECRET (or PD_CLUSTER_SECRET_FILE) from the environment,
else a fresh one, written to a file (mode 600) whose path launch prints
for pdctl's --cluster-secret-file and removes when it ends.`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return launchRun(cmd, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.model, "model", "", "GGUF model file for every server (default: the built-in small llama-dsa model, generated once into $PDKIT_HOME)")
	f.IntVar(&o.port, "port", 8000, "router port on 127.0.0.1 (0: pick a free one)")
	f.IntVar(&o.prefill, "prefill", 1, "prefill servers")
	f.IntVar(&o.decode, "decode", 1, "decode servers")
	f.IntVar(&o.tp, "tp", 1, "tensor-parallel ranks of each prefill and decode server")
	f.StringArrayVar(&o.faults, "fault", nil, "fault switch to turn on in the servers of its role (repeatable; e.g. bootstrap-abort-crash)")
	o.hicache.register(f)
	f.StringVar(&o.kvDType, "kv-dtype", kvDTypeFlagHelp.def, kvDTypeFlagHelp.usage)
	f.Var(&o.kvMemory, "kv-memory", "memory for each prefill and decode server's KV pools, every rank of it together: bytes (e.g. 2GiB) or a share of the memory a server may use (0.25 or 25%), each server taking its own (serve --kv-memory); default: max-running × context length")
	f.DurationVar(&o.readyTimeout, "ready-timeout", 2*time.Minute, "longest wait for every server to answer /health")
	f.DurationVar(&o.grace, "stop-timeout", 15*time.Second, "how long a stop waits after SIGTERM before it kills a server")
	return cmd
}

// launchPlan is the cluster's layout: the ports chosen and each server's
// command line.
type launchPlan struct {
	exe, model      string
	routerPort      int
	routerPortFixed bool // chosen by --port, not reserved here
	prefill         []prefillPorts
	decode          []int // HTTP ports
	tp              int
	faults          []string
	engineArgs      []string // flags every prefill and decode server gets (--kv-dtype)
	prefillArgs     []string // flags the prefill servers alone get (the --hicache ones set: a decode keeps no host tier)
	env             []string // every child's environment
}

type prefillPorts struct{ http, bootstrap int }

func loopbackURL(port int) string { return "http://127.0.0.1:" + strconv.Itoa(port) }

// specs turns the plan into child specs: prefill servers, decode servers,
// then the router.
func (p launchPlan) specs() []launch.Spec {
	var specs []launch.Spec
	add := func(name, role string, port int, args ...string) {
		specs = append(specs, launch.Spec{Name: name, Role: role, Path: p.exe, Args: args, Env: p.env,
			HealthURL: loopbackURL(port) + "/health"})
	}
	// Every server gets the engine args, the prefill servers the host
	// tier's; each fault goes to the servers of the roles it applies to.
	faults := func(role string, args []string) []string {
		if role == "prefill" {
			args = append(args, p.prefillArgs...)
		}
		args = append(args, p.engineArgs...)
		for _, f := range p.faults {
			if roles, _ := serve.FaultRoles(f); slices.Contains(roles, role) {
				args = append(args, "--fault", f)
			}
		}
		return args
	}
	tp := strconv.Itoa(p.tp)
	var prefillURLs, decodeURLs, registries []string
	for i, pp := range p.prefill {
		add(fmt.Sprintf("prefill-%d", i), "prefill", pp.http, faults("prefill", []string{"prefill", "--model", p.model,
			"--port", strconv.Itoa(pp.http), "--bootstrap-port", strconv.Itoa(pp.bootstrap), "--tp", tp})...)
		prefillURLs = append(prefillURLs, loopbackURL(pp.http))
		registries = append(registries, loopbackURL(pp.bootstrap))
	}
	// A decode takes requests only for the registries of this cluster's
	// prefills.
	for j, port := range p.decode {
		add(fmt.Sprintf("decode-%d", j), "decode", port, faults("decode", []string{"decode", "--model", p.model,
			"--port", strconv.Itoa(port), "--tp", tp, "--prefill-bootstrap", strings.Join(registries, ",")})...)
		decodeURLs = append(decodeURLs, loopbackURL(port))
	}
	add("router", "router", p.routerPort, "router", "--port", strconv.Itoa(p.routerPort),
		"--prefill", strings.Join(prefillURLs, ","), "--decode", strings.Join(decodeURLs, ","))
	// The router's port is the user's (--port), not one reserved here:
	// when it is taken, fresh ports would not help.
	specs[len(specs)-1].FixedPorts = p.routerPortFixed
	return specs
}

// childEnv is the launcher's environment without the PD_* variables of
// launch's own flags: each server gets those settings on its command line
// (and --prefill, a count here, is a URL list to the router), while any
// other PD_* setting reaches every server.
func childEnv(fs *pflag.FlagSet, environ []string) []string {
	own := map[string]bool{}
	fs.VisitAll(func(f *pflag.Flag) { own[config.EnvName(f.Name)] = true })
	var env []string
	for _, kv := range environ {
		k, _, _ := strings.Cut(kv, "=")
		if !own[k] {
			env = append(env, kv)
		}
	}
	return env
}

func launchRun(cmd *cobra.Command, o launchOptions) error {
	stderr := cmd.ErrOrStderr()
	if err := checkPort("--port", o.port); err != nil {
		return err
	}
	switch {
	case o.prefill < 1:
		return usagef("--prefill %d: want at least 1", o.prefill)
	case o.decode < 1:
		return usagef("--decode %d: want at least 1", o.decode)
	case o.tp < 1:
		return usagef("--tp %d: want at least 1", o.tp)
	case o.readyTimeout <= 0 || o.grace <= 0:
		return usagef("--ready-timeout and --stop-timeout must be positive")
	}
	for _, f := range o.faults {
		if _, ok := serve.FaultRoles(f); !ok {
			return usagef("--fault %q: not a fault switch", f)
		}
	}
	if _, err := parseKVDType(o.kvDType); err != nil {
		return err
	}
	// The servers would refuse these; say so before starting any.
	noPrefix, _ := strconv.ParseBool(os.Getenv(config.EnvName("no-prefix-cache")))
	if _, err := o.hicache.config(noPrefix); err != nil {
		if noPrefix && o.hicache.on {
			return usagef("--hicache needs the prefix cache, which %s turns off in the servers: drop one of them", config.EnvName("no-prefix-cache"))
		}
		return err
	}
	if o.port != 0 {
		// Fail early and clearly when the router's port is taken (retrying
		// with fresh ports cannot help: this one is fixed).
		ln, err := listen("127.0.0.1", o.port, "--port")
		if pt, ok := errors.AsType[*portTaken](err); ok {
			pt.make = true
			return fmt.Errorf("router: %w", pt)
		}
		if err != nil {
			return fmt.Errorf("router port: %w", err)
		}
		ln.Close()
	}
	exe, err := launchExecutable()
	if err != nil {
		return err
	}
	// Resolved once here, so the servers do not all generate it at once.
	model, err := resolveModel(o.model, stderr)
	if err != nil {
		return err
	}
	if model, err = filepath.Abs(model); err != nil {
		return err
	}
	if _, err := os.Stat(model); err != nil {
		return usagef("--model: %v", err)
	}
	env := childEnv(cmd.Flags(), os.Environ())
	env, secretFile, err := withClusterSecret(env)
	if err != nil {
		return err
	}
	if secretFile != "" {
		defer os.RemoveAll(filepath.Dir(secretFile))
		fmt.Fprintf(stderr, "launch: cluster secret generated for the servers; pdctl reads it with --cluster-secret-file %s\n", secretFile)
	}

	var plan launchPlan
	build := func() ([]launch.Spec, error) {
		n := 2*o.prefill + o.decode
		if o.port == 0 {
			n++
		}
		ports, err := launch.FreePorts(n)
		if err != nil {
			return nil, err
		}
		plan = launchPlan{exe: exe, model: model, routerPort: o.port, routerPortFixed: o.port != 0, tp: o.tp, faults: o.faults,
			engineArgs: engineArgs(o), prefillArgs: hicacheArgs(cmd.Flags()), env: env}
		for range o.prefill {
			plan.prefill = append(plan.prefill, prefillPorts{http: ports[0], bootstrap: ports[1]})
			ports = ports[2:]
		}
		plan.decode, ports = ports[:o.decode], ports[o.decode:]
		if plan.routerPort == 0 {
			plan.routerPort = ports[0]
		}
		return plan.specs(), nil
	}
	fmt.Fprintf(stderr, "launch: starting %d prefill and %d decode servers (tp %d) and a router\n", o.prefill, o.decode, o.tp)
	c, err := launch.Launch(cmd.Context(), build, launch.Options{Output: stderr, ReadyTimeout: o.readyTimeout, Grace: o.grace})
	if ce, ok := errors.AsType[*launch.ChildError](err); ok && ce.Name == "router" && plan.routerPortFixed && errors.Is(err, launch.ErrAddrInUse) {
		// Taken between the check above and the router's start.
		return fmt.Errorf("%w\nlaunch: the router's port %d is taken: %s", err, o.port, portHint("--port", true))
	}
	if err != nil {
		return err
	}
	if err := printEndpoints(cmd.OutOrStdout(), plan, c.Children()); err != nil {
		return errors.Join(err, c.Stop())
	}
	return c.Run(cmd.Context())
}

// printEndpoints writes the table of servers and a request to try.
func printEndpoints(w io.Writer, plan launchPlan, children []launch.Child) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ROLE\tNAME\tURL\tPID")
	for _, ch := range children {
		url := strings.TrimSuffix(ch.HealthURL, "/health")
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d", ch.Role, ch.Name, url, ch.Pid)
		var i int
		if _, err := fmt.Sscanf(ch.Name, "prefill-%d", &i); err == nil && ch.Role == "prefill" && i < len(plan.prefill) {
			fmt.Fprintf(tw, "\tbootstrap %s", loopbackURL(plan.prefill[i].bootstrap))
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "\ncurl -s %s/v1/completions -d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}'\n", loopbackURL(plan.routerPort))
	return err
}

// withClusterSecret gives the servers a cluster secret: the one in the
// environment (PD_CLUSTER_SECRET or PD_CLUSTER_SECRET_FILE) if set, else a
// fresh one, also written to a file of its own (mode 600, removed when
// launch ends) for pdctl; file is that file's path, "" when the secret
// came from the environment.
func withClusterSecret(env []string) (_ []string, file string, err error) {
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if (k == "PD_CLUSTER_SECRET" || k == "PD_CLUSTER_SECRET_FILE") && v != "" {
			return env, "", nil
		}
	}
	_, text := clusterauth.Generate()
	dir, err := os.MkdirTemp("", "pdkit-launch-")
	if err != nil {
		return nil, "", err
	}
	file = filepath.Join(dir, "cluster-secret")
	if err := os.WriteFile(file, []byte(text+"\n"), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, "", err
	}
	return append(env, "PD_CLUSTER_SECRET="+text), file, nil
}

// engineArgs are the flags launch hands every prefill and decode server.
func engineArgs(o launchOptions) []string {
	args := []string{"--kv-dtype=" + o.kvDType}
	if !o.kvMemory.IsZero() {
		args = append(args, "--kv-memory="+o.kvMemory.String())
	}
	return args
}
