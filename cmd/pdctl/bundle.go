package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
	"github.com/spf13/cobra"
)

type bundleOptions struct {
	f      *factory
	Attach *attachOptions
	Output string
	Window time.Duration
	Now    func() time.Time
}

func newCmdBundle(f *factory, runF func(context.Context, *bundleOptions) error) *cobra.Command {
	opts := &bundleOptions{f: f, Attach: &f.attach, Now: time.Now}
	cmd := &cobra.Command{
		Use:   "bundle -o FILE.tar.gz",
		Short: "Collect every server's state, queues, flight recorders, stacks, metrics and a diagnosis into one file",
		Long: `Collect into one gzipped tar file everything an engineer needs after the
fact. Per server, in a directory named by its role and host:port: info.json,
health.json, settings.json (the effective settings: timeouts, heartbeat,
fault switches on, TP size, index-K precision and a switch under way, ...),
state.json (settings, last step and engine snapshot, with its totals: the
index-K switches among them), steps.json (each rank's control and forward seqs),
collectives.json (the flight recorders of the control and the forward
communicator), requests.json, pd.json (prefill and decode), faults.json, gpu.json,
hicache.json (each rank's host tier: on or off, pool usage, totals, loads in
flight, gate waits), decisions.json (each rank's decision log: per step the
agreed input, every value agreed with its control seq, the plan and batch,
and the first step where the ranks' records part), stacks.txt (every
goroutine) and stacks-rank-N.txt per rank, metrics.txt.
At the top: cluster.json (the router's server list), diagnose.txt and
diagnose.json (pdctl diagnose over --window), and MANIFEST, which lists every
file and every server or endpoint that failed.

A failure is recorded in MANIFEST and the rest is still collected; only when
nothing answered at all does bundle fail (exit 2). The file is written
atomically: a temporary file renamed into place.`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if opts.Output == "" {
				return newUsageError(cmd, "bundle needs -o FILE.tar.gz")
			}
			if opts.Window <= 0 {
				return newUsageError(cmd, "--window must be positive")
			}
			if runF != nil {
				return runF(cmd.Context(), opts)
			}
			return bundleRun(cmd.Context(), opts)
		},
	}
	cmd.Flags().StringVarP(&opts.Output, "output", "o", "", "the file to write (a .tar.gz)")
	cmd.Flags().DurationVar(&opts.Window, "window", 2*time.Second, "the diagnose window")
	return cmd
}

// bundleFile is one file of the archive.
type bundleFile struct {
	name string
	data []byte
}

// bundle collects the files and the failures; safe for concurrent use.
type bundle struct {
	mu       sync.Mutex
	files    []bundleFile
	failures []string
}

func (b *bundle) add(name string, data []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.files = append(b.files, bundleFile{name: name, data: data})
}

func (b *bundle) fail(what string, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failures = append(b.failures, what+": "+strings.ReplaceAll(err.Error(), "\n", "; "))
}

// addJSON adds v as indented JSON, or records err.
func (b *bundle) addJSON(name string, v any, err error) {
	if err != nil {
		b.fail(name, err)
		return
	}
	var buf bytes.Buffer
	if err := writeJSON(&buf, v); err != nil {
		b.fail(name, err)
		return
	}
	b.add(name, buf.Bytes())
}

// serverDir names a server's directory: its role and host:port.
func serverDir(t *target) string {
	host := t.URL
	if u, err := url.Parse(t.URL); err == nil && u.Host != "" {
		host = u.Host
	}
	role := t.Role
	if role == "" {
		role = "unknown"
	}
	return role + "-" + strings.ReplaceAll(host, "/", "_")
}

func bundleRun(ctx context.Context, opts *bundleOptions) error {
	f := opts.f
	targets, err := attachAll(ctx, f, opts.Attach)
	if err != nil {
		return err
	}
	b := &bundle{}
	if len(opts.Attach.Servers) == 0 {
		cr, err := client.New(opts.Attach.Router, opts.Attach.token(f), opts.Attach.HTTP).Cluster(ctx)
		b.addJSON("cluster.json", cr, err)
	}
	fmt.Fprintf(f.ErrOut, "collecting from %s…\n", pluralf(len(targets), "server", "servers"))
	answered := make([]bool, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() { answered[i] = collectServer(ctx, b, t) })
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return err
	}
	for i, t := range targets {
		if !answered[i] {
			b.fail(serverDir(t)+"/", fmt.Errorf("the server at %s did not answer", t.URL))
		}
	}
	if !slices.Contains(answered, true) {
		return &cannotRunError{err: errors.New("no server answered: " + strings.Join(b.failures, "; "))}
	}

	fmt.Fprintf(f.ErrOut, "diagnosing for %v…\n", opts.Window)
	interval := min(opts.Window, 500*time.Millisecond)
	findings, _, err := diagnose(ctx, probe{targets: targets, router: opts.Attach.routerClient(f)}, opts.Window, interval, diag.DefaultConfig(), nil)
	var noRun *cannotRunError
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.As(err, &noRun):
		b.fail("diagnose", err)
	case err != nil:
		return err
	default:
		var txt bytes.Buffer
		printFindings(&txt, findings, true)
		b.add("diagnose.txt", txt.Bytes())
		b.addJSON("diagnose.json", findings, nil)
	}

	n, err := writeBundle(opts.Output, b, opts.Now())
	if err != nil {
		return err
	}
	fmt.Fprintf(f.ErrOut, "wrote %s: %s, %s\n", opts.Output, pluralf(n, "file", "files"), pluralf(len(b.failures), "failure", "failures"))
	return nil
}

// collectServer adds one server's files to b and reports whether the
// server answered at all.
func collectServer(ctx context.Context, b *bundle, t *target) bool {
	if info, err := t.c.Info(ctx); err == nil {
		t.Role, t.TPSize, t.Model = info.Role, info.TPSize, info.Model
	}
	dir := serverDir(t) + "/"
	c := t.c
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		answered bool
	)
	ok := func(err error) {
		if err == nil || client.StatusOf(err) != 0 {
			mu.Lock()
			answered = true
			mu.Unlock()
		}
	}
	getJSON := func(name, path string) {
		wg.Go(func() {
			var raw json.RawMessage
			err := c.GetJSON(ctx, path, &raw)
			ok(err)
			b.addJSON(dir+name, raw, err)
		})
	}
	getJSON("info.json", "/pd/v1/info")
	getJSON("settings.json", debug.SettingsPath)
	getJSON("state.json", debug.StatePath)
	getJSON("steps.json", "/debug/v1/steps")
	getJSON("collectives.json", "/debug/v1/collectives")
	getJSON("requests.json", "/debug/v1/requests")
	getJSON("faults.json", "/debug/v1/faults")
	getJSON("gpu.json", "/debug/v1/gpu")
	getJSON("hicache.json", debug.HiCachePath)
	getJSON("decisions.json", debug.DecisionsPath)
	if isPD(t.Role) {
		getJSON("pd.json", "/debug/v1/pd")
	}
	wg.Go(func() {
		err := c.Health(ctx)
		ok(err)
		h := struct {
			Healthy bool   `json:"healthy"`
			Reason  string `json:"reason,omitempty"`
		}{Healthy: err == nil}
		if client.StatusOf(err) != 0 {
			var ae *client.APIError
			errorsAs(err, &ae)
			h.Reason, err = ae.Message, nil
		}
		b.addJSON(dir+"health.json", h, err)
	})
	text := func(name string, get func() (string, error)) {
		wg.Go(func() {
			s, err := get()
			ok(err)
			if err != nil {
				b.fail(dir+name, err)
				return
			}
			b.add(dir+name, []byte(s))
		})
	}
	text("stacks.txt", func() (string, error) { return c.Stacks(ctx, -1) })
	for r := range t.TPSize {
		text(fmt.Sprintf("stacks-rank-%d.txt", r), func() (string, error) { return c.Stacks(ctx, r) })
	}
	text("metrics.txt", func() (string, error) { return c.Metrics(ctx) })
	wg.Wait()
	return answered
}

// writeBundle writes b to path atomically, with a MANIFEST first, and
// returns the number of files in the archive.
func writeBundle(path string, b *bundle, now time.Time) (int, error) {
	slices.SortFunc(b.files, func(x, y bundleFile) int { return strings.Compare(x.name, y.name) })
	slices.Sort(b.failures)
	var m strings.Builder
	fmt.Fprintf(&m, "pdctl bundle, %s\n\nfiles:\n", now.UTC().Format(time.RFC3339))
	for _, fl := range b.files {
		fmt.Fprintf(&m, "%s\t%d\n", fl.name, len(fl.data))
	}
	m.WriteString("\nfailures:\n")
	for _, fl := range b.failures {
		fmt.Fprintf(&m, "%s\n", fl)
	}
	if len(b.failures) == 0 {
		m.WriteString("none\n")
	}
	files := append([]bundleFile{{name: "MANIFEST", data: []byte(m.String())}}, b.files...)

	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return 0, err
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	gz := gzip.NewWriter(tmp)
	tw := tar.NewWriter(gz)
	for _, fl := range files {
		hdr := &tar.Header{Name: fl.name, Mode: 0o644, Size: int64(len(fl.data)), ModTime: now, Typeflag: tar.TypeReg}
		if err := tw.WriteHeader(hdr); err != nil {
			tmp.Close()
			return 0, err
		}
		if _, err := tw.Write(fl.data); err != nil {
			tmp.Close()
			return 0, err
		}
	}
	err = errors.Join(tw.Close(), gz.Close(), tmp.Sync())
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return 0, fmt.Errorf("writing %s: %w", path, err)
	}
	return len(files), nil
}
