package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/bench"
	"github.com/pdkit/pdkit/internal/launch"
)

// newBenchLoadCmd is `pdserve bench load`: many sessions at once against a
// real PD cluster (child processes, as `pdserve launch` starts them).
func newBenchLoadCmd() *cobra.Command {
	var cfg bench.LoadConfig
	var routerArgs []string
	overloadBound := 0
	cmd := &cobra.Command{
		Use:   "load [--sessions 200] [--max-tokens 400] [--prompt 64]",
		Short: "Measure a PD cluster under load: many streamed sessions at once through the router",
		Long: `load starts a PD cluster as ` + "`pdserve launch`" + ` does with its defaults (a router, one
prefill and one decode server, the built-in model, child processes on loopback) and
sends --sessions streamed completions at once through the router (random token-id
prompts, temperature 0, ignore_eos). Busy is not dead: every session must complete,
queued as long as it takes, and none may fail inside the cluster. It reports sessions
completed, refused at the edge and failed, the output rate, and TTFT and end-to-end
latency percentiles, and each server's queue time. Then, unless --overload-bound is 0, it
runs the same sessions against a fresh cluster whose router admits at most that many
queued requests per server: the excess must be refused at the edge at once (429 with
Retry-After), and nothing admitted may fail inside the cluster.`,
		Example: `  # 200 sessions × 400 tokens on make run's cluster shape
  $ pdserve bench load
  # a shorter run
  $ pdserve bench load --sessions 40 --max-tokens 100`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.Sessions < 1 || cfg.MaxTokens < 1 || cfg.PromptLen < 1 {
				return usagef("--sessions, --max-tokens and --prompt must be positive")
			}
			spec := builtin.Default()
			shape, err := builtin.Shape(spec.Arch, spec.Size)
			if err != nil {
				return err
			}
			if err := checkFits(cfg.PromptLen, cfg.MaxTokens, shape.ContextLen); err != nil {
				return err
			}
			cfg.Vocab = shape.VocabSize
			if overloadBound < 0 {
				return usagef("--overload-bound %d must not be negative (0: no overload run)", overloadBound)
			}
			rep, err := loadRun(cmd, cfg, routerArgs)
			if err != nil {
				return err
			}
			rep.Print(cmd.OutOrStdout(), "load")
			if rep.Failed > 0 || rep.Refused > 0 {
				return fmt.Errorf("bench load: %d sessions failed and %d were refused; every one should have completed", rep.Failed, rep.Refused)
			}
			if overloadBound == 0 {
				return nil
			}
			over, err := loadRun(cmd, cfg, append(slices.Clone(routerArgs), "--max-queued", strconv.Itoa(overloadBound)))
			if err != nil {
				return err
			}
			over.Print(cmd.OutOrStdout(), fmt.Sprintf("overload (router --max-queued %d)", overloadBound))
			switch {
			case over.Failed > 0:
				return fmt.Errorf("bench load: %d admitted sessions failed inside the cluster under overload", over.Failed)
			case over.Refused == 0:
				return fmt.Errorf("bench load: the router refused nothing past its bound of %d: the overload run measured nothing", overloadBound)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Sessions, "sessions", 200, "streamed sessions sent at once")
	f.IntVar(&cfg.PromptLen, "prompt", 64, "prompt length in tokens")
	f.IntVar(&cfg.MaxTokens, "max-tokens", 400, "tokens generated per session")
	f.StringArrayVar(&routerArgs, "router-arg", nil, "an extra flag for the cluster's router (repeatable)")
	f.IntVar(&overloadBound, "overload-bound", 40, "the router's --max-queued in the overload run (0: no overload run)")
	return cmd
}

// loadRun runs one load against a fresh cluster.
func loadRun(cmd *cobra.Command, cfg bench.LoadConfig, routerArgs []string) (bench.LoadReport, error) {
	plan, stop, err := startBenchCluster(cmd, routerArgs)
	if err != nil {
		return bench.LoadReport{}, err
	}
	defer stop()
	cfg.URL = loopbackURL(plan.routerPort)
	cfg.Servers = []bench.LoadServer{{Name: "prefill", URL: loopbackURL(plan.prefill[0].http)}, {Name: "decode", URL: loopbackURL(plan.decode[0])}}
	return bench.RunLoad(cmd.Context(), cfg, cmd.ErrOrStderr())
}

// startBenchCluster starts `pdserve launch`'s default cluster on free
// ports with the built-in model, its output kept out of the report, and
// returns its layout and how to stop it all.
func startBenchCluster(cmd *cobra.Command, routerArgs []string) (launchPlan, func(), error) {
	stderr := cmd.ErrOrStderr()
	var plan launchPlan
	exe, err := launchExecutable()
	if err != nil {
		return plan, nil, err
	}
	path, err := resolveModel("", stderr)
	if err != nil {
		return plan, nil, err
	}
	if path, err = filepath.Abs(path); err != nil {
		return plan, nil, err
	}
	build := func() ([]launch.Spec, error) {
		ports, err := launch.FreePorts(4)
		if err != nil {
			return nil, err
		}
		plan = launchPlan{exe: exe, model: path, routerPort: ports[3], tp: 1, env: os.Environ(),
			prefill: []prefillPorts{{http: ports[0], bootstrap: ports[1]}}, decode: ports[2:3]}
		specs := plan.specs()
		router := &specs[len(specs)-1]
		router.Args = append(router.Args, routerArgs...)
		return specs, nil
	}
	fmt.Fprintln(stderr, "bench load: starting a router, one prefill and one decode server")
	c, err := launch.Launch(cmd.Context(), build, launch.Options{Output: io.Discard})
	if err != nil {
		return plan, nil, err
	}
	return plan, func() { c.Stop() }, nil
}
