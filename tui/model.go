package tui

import (
	"context"
	"io"
	"time"

	tea "charm.land/bubbletea/v2"
	"github.com/charmbracelet/x/ansi"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/diag"
)

// Sample is one reading of the cluster as the view shows it: diag's
// sample, which the rules judge, and what only the view shows beside it.
type Sample struct {
	diag.Sample
	// HiCache is each server's host tier (GET /debug/v1/hicache) by URL; a
	// server missing did not answer it.
	HiCache map[string]*debug.HiCacheResponse `json:"hicache,omitempty"`
}

// diagSamples is the diag samples of window, for the rules.
func diagSamples(window []Sample) []diag.Sample {
	out := make([]diag.Sample, len(window))
	for i, s := range window {
		out[i] = s.Sample
	}
	return out
}

// Options configure the live view.
type Options struct {
	// Fetch reads the cluster once; it must return by the context's end.
	Fetch func(context.Context) (Sample, error)
	// Interval is the time between two samples (default 1s); Window how
	// far back the samples the rules judge go (default 5s).
	Interval, Window time.Duration
	Source           string
	Config           diag.Config
	Now              func() time.Time // default time.Now
	// Width and Height set the screen's size when out is not a terminal
	// that can tell it; zero: ask the terminal.
	Width, Height int
}

// Model is the Bubble Tea model of "pdctl top": it samples the cluster
// every Interval through Fetch, keeps the samples of the last Window, and
// draws them with Frame. Keys: q (or esc, ctrl+c) quits, p (or space)
// pauses and resumes, r samples at once.
type Model struct {
	ctx      context.Context
	opts     Options
	samples  []Sample
	err      error
	paused   bool
	fetching bool
	width    int
}

// sampleMsg carries one Fetch result.
type sampleMsg struct {
	sample Sample
	err    error
}

// tickMsg says the interval since the last sample has passed.
type tickMsg struct{}

// New returns the model; ctx bounds every Fetch (cancel it to end them).
func New(ctx context.Context, o Options) *Model {
	if o.Interval <= 0 {
		o.Interval = time.Second
	}
	if o.Window <= 0 {
		o.Window = 5 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Model{ctx: ctx, opts: o}
}

// Init takes the first sample.
func (m *Model) Init() tea.Cmd { return m.fetch() }

// fetch starts one Fetch unless one runs; its result comes as a sampleMsg.
func (m *Model) fetch() tea.Cmd {
	if m.fetching {
		return nil
	}
	m.fetching = true
	ctx, fetch, bound := m.ctx, m.opts.Fetch, max(m.opts.Interval, 2*time.Second)
	return func() tea.Msg {
		ctx, cancel := context.WithTimeout(ctx, bound)
		defer cancel()
		s, err := fetch(ctx)
		return sampleMsg{sample: s, err: err}
	}
}

// Update handles samples, ticks, keys and the window's size.
func (m *Model) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case sampleMsg:
		m.fetching = false
		m.err = msg.err
		if msg.err == nil {
			m.add(msg.sample)
		}
		return m, tea.Tick(m.opts.Interval, func(time.Time) tea.Msg { return tickMsg{} })
	case tickMsg:
		if m.paused {
			return m, nil
		}
		return m, m.fetch()
	case tea.KeyPressMsg:
		switch msg.String() {
		case "q", "esc", "ctrl+c":
			return m, tea.Quit
		case "p", "space":
			m.paused = !m.paused
			if !m.paused {
				return m, m.fetch()
			}
		case "r":
			return m, m.fetch()
		}
	case tea.WindowSizeMsg:
		m.width = msg.Width
	}
	return m, nil
}

// add keeps s and drops the samples older than the window before it.
func (m *Model) add(s Sample) {
	m.samples = append(m.samples, s)
	from := s.Taken.Add(-m.opts.Window)
	i := 0
	for i < len(m.samples)-1 && m.samples[i].Taken.Before(from) {
		i++
	}
	m.samples = m.samples[i:]
}

// View draws the frame, styled, in the alternate screen.
func (m *Model) View() tea.View {
	v := tea.NewView(m.frame(true) + "\nq quit · p pause · r refresh\n")
	v.AltScreen = true
	v.WindowTitle = "pdctl top"
	return v
}

// frame renders the samples kept so far.
func (m *Model) frame(styled bool) string {
	return Frame(m.samples, FrameOptions{Source: m.opts.Source, Interval: m.opts.Interval, Paused: m.paused, Err: m.err,
		Styled: styled, Width: m.width, Config: m.opts.Config, Now: m.opts.Now()})
}

// Samples returns the samples the model keeps, oldest first.
func (m *Model) Samples() []Sample { return m.samples }

// truncate cuts a styled line to width cells.
func truncate(s string, width int) string { return ansi.Truncate(s, width, "…") }

// Run runs the live view on in and out until the user quits or ctx ends.
func Run(ctx context.Context, in io.Reader, out io.Writer, o Options) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends a Fetch in flight
	popts := []tea.ProgramOption{tea.WithContext(ctx), tea.WithInput(in), tea.WithOutput(out)}
	if o.Width > 0 && o.Height > 0 {
		popts = append(popts, tea.WithWindowSize(o.Width, o.Height))
	}
	p := tea.NewProgram(New(ctx, o), popts...)
	_, err := p.Run()
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
