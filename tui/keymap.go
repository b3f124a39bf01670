package tui

import (
	"slices"
	"strings"

	tea "charm.land/bubbletea/v2"
)

// Binding is one action of the view: the keys that trigger it (as
// tea.KeyPressMsg.String spells them) and how the help line names it.
// The same value decides what a key press does and what the help line
// says, so the two cannot drift apart.
type Binding struct {
	Keys []string
	Help string // the keys as the help line shows them: "q/esc"
	Desc string // what it does: "quit"
}

// Matches reports whether the key press triggers b.
func (b Binding) Matches(msg tea.KeyPressMsg) bool { return slices.Contains(b.Keys, msg.String()) }

// KeyMap is every binding of the view.
type KeyMap struct {
	Quit, Pause, Refresh Binding
}

// DefaultKeyMap is the keys of "pdctl top".
var DefaultKeyMap = KeyMap{
	Quit:    Binding{Keys: []string{"q", "esc", "ctrl+c"}, Help: "q", Desc: "quit"},
	Pause:   Binding{Keys: []string{"p", "space"}, Help: "p", Desc: "pause"},
	Refresh: Binding{Keys: []string{"r"}, Help: "r", Desc: "refresh"},
}

// Bindings lists the bindings in the order the help line shows them.
func (k KeyMap) Bindings() []Binding { return []Binding{k.Quit, k.Pause, k.Refresh} }

// HelpLine is the one-line help: "q quit · p pause · r refresh".
func (k KeyMap) HelpLine() string {
	var parts []string
	for _, b := range k.Bindings() {
		parts = append(parts, b.Help+" "+b.Desc)
	}
	return strings.Join(parts, " · ")
}

// HelpText says the keys in a sentence for a command's long help: "q
// (esc, ctrl+c) quits, ...".
func (k KeyMap) HelpText() string {
	var parts []string
	for _, b := range k.Bindings() {
		p := b.Keys[0]
		if len(b.Keys) > 1 {
			p += " (" + strings.Join(b.Keys[1:], ", ") + ")"
		}
		parts = append(parts, p+" "+b.Desc)
	}
	return strings.Join(parts, ", ")
}
