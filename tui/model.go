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
// draws them with Frame, with each rank's step rate over the last
// samples (History). Its keys are DefaultKeyMap's: q (or esc, ctrl+c)
// quits, p (or space) pauses and resumes, r samples at once; the help line
// is drawn from the same bindings.
type Model struct {
	ctx      context.Context
	opts     Options
	keys     KeyMap
	samples  []Sample
	history  *History
	err      error
	paused   bool
	fetching bool
	width    int
	height   int
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
	return &Model{ctx: ctx, opts: o, keys: DefaultKeyMap, history: NewHistory(0), width: o.Width, height: o.Height}
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
		switch {
		case m.keys.Quit.Matches(msg):
			return m, tea.Quit
		case m.keys.Pause.Matches(msg):
			m.paused = !m.paused
			if !m.paused {
				return m, m.fetch()
			}
		case m.keys.Refresh.Matches(msg):
			return m, m.fetch()
		}
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
	}
	return m, nil
}

// add keeps s and drops the samples older than the window before it.
func (m *Model) add(s Sample) {
	m.samples = append(m.samples, s)
	m.history.Add(s.Sample)
	from := s.Taken.Add(-m.opts.Window)
	i := 0
	for i < len(m.samples)-1 && m.samples[i].Taken.Before(from) {
		i++
	}
	m.samples = m.samples[i:]
}

// View draws the screen, styled, in the alternate screen.
func (m *Model) View() tea.View {
	v := tea.NewView(m.screen(true))
	v.AltScreen = true
	v.WindowTitle = "pdctl top"
	return v
}

// screen is the frame of the samples kept so far fitted to the screen's
// size, and the help line beneath, drawn from the keymap.
func (m *Model) screen(styled bool) string {
	height := 0
	if m.height > 0 {
		height = max(1, m.height-2) // a blank line and the help
	}
	o := FrameOptions{Source: m.opts.Source, Interval: m.opts.Interval, Paused: m.paused, Err: m.err,
		Styled: styled, Width: m.width, Height: height, History: m.history, Config: m.opts.Config, Now: m.opts.Now()}
	help := m.keys.HelpLine()
	if m.width > 0 {
		help = truncate(help, m.width)
	}
	return Frame(m.samples, o) + "\n" + o.style(styleDim, help) + "\n"
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
