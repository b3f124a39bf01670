package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/internal/abtest"
	"github.com/pdkit/pdkit/internal/config"
	"github.com/spf13/cobra"
)

// pdctl indexk ab: the A/B test of production incident 3 (the HiCache
// index-K race) against a live cluster. The command, its flags and its
// output are here; indexkab_run.go switches the servers and runs the cells,
// internal/abtest holds the workload and the comparison.

type indexkABOptions struct {
	f      *factory
	Attach *attachOptions

	Sessions   int
	Requests   int // 0: two conversations per session
	Turns      int
	MaxTokens  int
	Precisions []string
	HiCache    []string
	// LoadBandwidth paces the loaders during the run when SetBandwidth
	// (--load-bandwidth given); else the servers keep theirs.
	LoadBandwidth  config.Rate
	SetBandwidth   bool
	Prompts        string // a prompts file; "": the built-in script
	Seed           uint64
	RequestTimeout time.Duration
	Drain          time.Duration
	JSON           bool
}

const indexkABLong = `Runs the same workload at the same concurrency in every cell of index-K
precision × HiCache state against the live cluster, through the router
(--router; --server names the servers to switch instead of the router's
listing), and compares every output with a reference:

1. References, one set per precision (the precision legitimately changes
   which tokens the sparse indexer selects): the servers are switched to it
   with HiCache off, and each prompt runs once, alone, greedy, with no_cache
   (the server computes the whole prompt, reading nothing cached).
2. Cells: for each precision and HiCache state, the servers are switched
   live (index-K: prefill servers first, then decode servers, so that the
   pair runs one precision again; each drains for at most --drain), and
   --sessions sessions run their multi-turn conversations at once. The
   conversations share a long prefix and grow a scripted history turn by
   turn (never the model's own output, so every prompt is known up front);
   the built-in script is sized from the pools the servers report, so that
   the histories do not fit the device KV pool and come back from the host
   tier. --prompts takes your own (JSON Lines: one conversation per line, an
   array of prompts, each a string or an array of token ids).
3. The matrix: per cell the outputs that differ from their reference
   (corrupt), timeouts and errors, time to first token and between tokens
   (p50, p99), and HiCache host hits and the tokens they loaded. Then the
   settings found are restored (index-K, HiCache on or off, load pacing).

Greedy decoding in pdkit is batch-invariant: a prompt gives the same tokens
whatever runs beside it and wherever its KV came from. So an output that
differs from its reference is corruption, not noise.

--load-bandwidth paces every server's loads back from host during the run
(a CPU build's way to get a GPU's copy-to-compute ratio); fault switches
are left as they are, and named in the verdict. Admin calls use --token.
Progress goes to stderr. Exit status: 0 no cell shows corruption, 1 some
cell does (the message names the cells and the switches on), 2 it could not
run (no router, no sparse indexer, a reference that failed, ...).`

// indexkABExample is indented as cobra prints it under "Examples:" (the
// examples map of examples.go is indented for its commands by cliexamples).
const indexkABExample = `  # The incident's matrix on the cluster behind the router on :8000
  $ pdctl indexk ab

  # A shorter run: 20 sessions, 240 requests, bf16 only, HiCache on only
  $ pdctl indexk ab --sessions 20 --requests 240 --precisions bf16 --hicache on

  # Loads back from host paced to 64MiB/s per rank, as JSON
  $ pdctl indexk ab --load-bandwidth 64MiB/s --json

  # Your own conversations
  $ pdctl indexk ab --prompts sessions.jsonl`

// newCmdIndexKAB is "pdctl indexk ab"; the indexk command adds it beside
// set and status.
func newCmdIndexKAB(f *factory, runF func(context.Context, *indexkABOptions) error) *cobra.Command {
	opts := &indexkABOptions{f: f, Attach: &f.attach}
	cmd := &cobra.Command{
		Use:     "ab",
		Short:   "A/B the index-K precisions and HiCache under load: corrupt outputs, timeouts, latency",
		Long:    indexkABLong,
		Example: indexkABExample,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := opts.validate(cmd); err != nil {
				return err
			}
			opts.SetBandwidth = cmd.Flags().Changed("load-bandwidth")
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return indexkABRun(cmd.Context(), opts)
		},
	}
	fl := cmd.Flags()
	fl.IntVar(&opts.Sessions, "sessions", 60, "conversations at once")
	fl.IntVar(&opts.Requests, "requests", 0, "requests per cell (0: two conversations per session)")
	fl.IntVar(&opts.Turns, "turns", 6, "turns of a built-in conversation on average")
	fl.IntVar(&opts.MaxTokens, "max-tokens", 8, "greedy tokens per request")
	fl.StringSliceVar(&opts.Precisions, "precisions", []string{debug.IndexKFP8, debug.IndexKBF16}, "index-K precisions, in order")
	fl.StringSliceVar(&opts.HiCache, "hicache", []string{"on", "off"}, "HiCache states, in order")
	fl.Var(&opts.LoadBandwidth, "load-bandwidth", "pace the loads back from host during the run (e.g. 64MiB/s; 0: unlimited; default: as the servers have it)")
	fl.StringVar(&opts.Prompts, "prompts", "", "JSON Lines file of conversations to run instead of the built-in script")
	fl.Uint64Var(&opts.Seed, "seed", 1, "seed of the built-in script")
	fl.DurationVar(&opts.RequestTimeout, "request-timeout", abtest.DefaultTimeout, "bound on one request, waiting included")
	fl.DurationVar(&opts.Drain, "drain", debug.IndexKDefaultDrain, "bound on a server's drain before an index-K switch")
	fl.BoolVar(&opts.JSON, "json", false, "print a JSON object")
	return cmd
}

func (o *indexkABOptions) validate(cmd *cobra.Command) error {
	switch {
	case o.Sessions < 1:
		return newUsageError(cmd, "--sessions %d: want at least 1", o.Sessions)
	case o.Requests < 0:
		return newUsageError(cmd, "--requests %d: want 0 (the default) or more", o.Requests)
	case o.Turns < 1:
		return newUsageError(cmd, "--turns %d: want at least 1", o.Turns)
	case o.MaxTokens < 1:
		return newUsageError(cmd, "--max-tokens %d: want at least 1", o.MaxTokens)
	case o.RequestTimeout <= 0:
		return newUsageError(cmd, "--request-timeout %v: want a positive duration", o.RequestTimeout)
	case o.Drain < 0:
		return newUsageError(cmd, "--drain %v: want a non-negative duration", o.Drain)
	}
	if err := checkList(cmd, "--precisions", o.Precisions, debug.IndexKFP8, debug.IndexKBF16); err != nil {
		return err
	}
	return checkList(cmd, "--hicache", o.HiCache, "on", "off")
}

// checkList refuses an empty list, a value not in allowed and a repeated
// one.
func checkList(cmd *cobra.Command, flag string, list []string, allowed ...string) error {
	if len(list) == 0 {
		return newUsageError(cmd, "%s: want at least one of %v", flag, allowed)
	}
	for i, v := range list {
		if !slices.Contains(allowed, v) {
			return newUsageError(cmd, "%s: unknown value %q (want %v)", flag, v, allowed)
		}
		if slices.Contains(list[:i], v) {
			return newUsageError(cmd, "%s: %q twice", flag, v)
		}
	}
	return nil
}

// script is the workload: the --prompts file's, else the built-in one
// sized by pool.
func (o *indexkABOptions) script(pool abtest.Pool) (abtest.Script, abWorkload, error) {
	w := abWorkload{Sessions: o.Sessions, MaxTokens: o.MaxTokens, DeviceTokens: pool.DeviceTokens, HostTokens: pool.HostTokens}
	var s abtest.Script
	if o.Prompts != "" {
		fh, err := os.Open(o.Prompts)
		if err != nil {
			return s, w, err
		}
		defer fh.Close()
		s, err = abtest.ReadPrompts(fh)
		if err != nil {
			return s, w, fmt.Errorf("%s: %w", o.Prompts, err)
		}
		if o.Requests > 0 {
			s = truncate(s, o.Requests)
		}
		w.Source = o.Prompts
	} else {
		p, err := abtest.Size(pool, o.Sessions, o.Requests, o.Turns, o.MaxTokens)
		if err != nil {
			return s, w, err
		}
		s = abtest.Generate(p, o.Seed)
		w.Source, w.SystemTokens, w.PerTurnTokens, w.WorkingSetTokens = "built-in", p.System, p.PerTurn, p.WorkingSet
	}
	w.Requests, w.Conversations, w.MaxTurns = s.Requests(), len(s.Convs), s.MaxTurns()
	if lo, hi, mean, ok := s.Lengths(); ok {
		w.PromptTokensMin, w.PromptTokensMax, w.PromptTokensMean = lo, hi, mean
		if hi+o.MaxTokens > pool.ContextTokens {
			return s, w, fmt.Errorf("the longest prompt (%d tokens) and %d generated tokens exceed the model's context (%d tokens)", hi, o.MaxTokens, pool.ContextTokens)
		}
	}
	return s, w, nil
}

// truncate keeps the first n prompts of s, conversation by conversation.
func truncate(s abtest.Script, n int) abtest.Script {
	var out abtest.Script
	for _, c := range s.Convs {
		if n <= 0 {
			break
		}
		c = c[:min(len(c), n)]
		out.Convs = append(out.Convs, c)
		n -= len(c)
	}
	return out
}

// abReport is the output of indexk ab (--json): the workload, the switches
// on, the references, the cells, and what was restored.
type abReport struct {
	Router   string     `json:"router"`
	Workload abWorkload `json:"workload"`
	// LoadBandwidthBytesPerSecond is --load-bandwidth; null when the
	// servers kept their own pacing.
	LoadBandwidthBytesPerSecond *int64 `json:"load_bandwidth_bytes_per_second"`
	// Servers are the servers switched, with what they ran when the
	// command found them and the fault switches on.
	Servers    []abServerState `json:"servers"`
	References []abReferences  `json:"references"`
	Cells      []abtest.Cell   `json:"cells"`
	// CorruptCells counts the cells with a corrupt output.
	CorruptCells int `json:"corrupt_cells"`
	// Restored says every server is back as found; RestoreErrors says
	// where it is not.
	Restored      bool     `json:"restored"`
	RestoreErrors []string `json:"restore_errors,omitempty"`
}

// abWorkload describes the script every cell runs.
type abWorkload struct {
	Source        string `json:"source"` // "built-in" or the --prompts file
	Sessions      int    `json:"sessions"`
	Requests      int    `json:"requests"`
	Conversations int    `json:"conversations"`
	MaxTurns      int    `json:"max_turns"`
	MaxTokens     int    `json:"max_tokens"`
	// The prompts' lengths in tokens; 0 when some are text.
	PromptTokensMin  int `json:"prompt_tokens_min"`
	PromptTokensMax  int `json:"prompt_tokens_max"`
	PromptTokensMean int `json:"prompt_tokens_mean"`
	// The built-in script's shape: the shared prefix, the tokens a turn
	// adds, and the sessions' histories halfway through (0 with
	// --prompts).
	SystemTokens     int `json:"system_tokens"`
	PerTurnTokens    int `json:"per_turn_tokens"`
	WorkingSetTokens int `json:"working_set_tokens"`
	// The pools it was sized against, per rank (host 0: not known).
	DeviceTokens int `json:"device_tokens"`
	HostTokens   int `json:"host_tokens"`
}

// abServerState is a server as indexk ab found it.
type abServerState struct {
	URL    string `json:"url"`
	Role   string `json:"role"`
	IndexK string `json:"index_k"` // "" when the model has no indexer
	// HiCache is on or off; "" on a server without a host tier (no prefix
	// cache, or a decode, which keeps none).
	HiCache                     string   `json:"hicache"`
	LoadBandwidthBytesPerSecond int64    `json:"load_bandwidth_bytes_per_second"`
	FaultsOn                    []string `json:"faults_on"`
}

// abReferences is one precision's set of references.
type abReferences struct {
	IndexK   string  `json:"index_k"`
	Requests int     `json:"requests"`
	Seconds  float64 `json:"seconds"`
}

// print writes the report: JSON with --json, else the matrix.
func (r *abReport) print(f *factory, asJSON bool) error {
	if asJSON {
		return writeJSON(f.Out, r)
	}
	tab := newTable([]string{"INDEX-K", "HICACHE", "REQUESTS", "CORRUPT", "SHARE", "TIMEOUTS", "ERRORS",
		"TTFT P50", "TTFT P99", "ITL P50", "ITL P99", "HOST HITS", "HIT TOKENS", "TIME"},
		"TTFT P50", "TTFT P99", "ITL P50", "ITL P99", "HOST HITS", "HIT TOKENS", "TIME")
	for _, c := range r.Cells {
		tab.add(c.IndexK, c.HiCache, itoa(c.Requests), itoa(c.Corrupt), fmt.Sprintf("%.1f%%", 100*c.CorruptShare),
			itoa(c.Timeouts), itoa(c.Errors), fmtLatency(c.TTFTMS.P50), fmtLatency(c.TTFTMS.P99), fmtLatency(c.ITLMS.P50), fmtLatency(c.ITLMS.P99),
			fmt.Sprint(c.HostHits), fmt.Sprint(c.HitTokens), fmt.Sprintf("%.1fs", c.Seconds))
	}
	return tab.print(f)
}

// fmtLatency writes milliseconds: "85µs", "12.3ms", "1.25s".
func fmtLatency(ms float64) string {
	switch {
	case ms >= 1000:
		return fmt.Sprintf("%.2fs", ms/1000)
	case ms < 1:
		return fmt.Sprintf("%.0fµs", ms*1000)
	}
	return fmt.Sprintf("%.1fms", ms)
}
