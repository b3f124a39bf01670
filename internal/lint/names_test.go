package lint

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/diag"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/helptest"
)

// The texts that tell an operator what to type (every help text of pdserve
// and pdctl, every diag rule's doc, summary and remedy) may name only fault
// switches that the engine's registry has and flags that pdserve's or
// pdctl's flag sets have. Both sets are read from the code (the registry
// through serve.FaultRoles, the flags from the built binaries' help), so a
// fault or flag added later is known at once, and one removed or renamed
// makes every text that still names it fail here.

// text is one text to check and where it comes from.
type text struct{ where, body string }

// Names in texts. A flag is "--name". A fault switch is a kebab-case name
// (with at least one hyphen) that the text calls a fault: right after
// "fault", "faults", "fault switch(es)" (optionally "such as"), "--fault",
// "fault on|off|list", as a list ("the faults a-b and c-d"), or right
// before "fault" or "switch"; and any drop-* or delay-* name, the
// per-message-type switches.
var (
	flagRef  = regexp.MustCompile(`(?:^|[^A-Za-z0-9_-])--([a-z0-9][a-z0-9-]*)`)
	kebab    = `[a-z0-9]+(?:-[a-z0-9]+)+`
	faultRef = regexp.MustCompile(`(?:--fault[ =]|\bfault (?:on |off |list )?|\bfaults |\bfault switch(?:es)? |\bswitch(?:es)? such as )(?:such as )?((?:` +
		kebab + `)(?:(?:, | and | or |/)(?:` + kebab + `))*)`)
	faultBefore = regexp.MustCompile(`\b(` + kebab + `) (?:fault|switch)\b`)
	typeSwitch  = regexp.MustCompile(`(?:^|[^A-Za-z0-9_-])((?:drop|delay)-[a-z0-9]+(?:-[a-z0-9]+)*)`)
	kebabWord   = regexp.MustCompile(kebab)
)

// namesIn returns the flags and the fault switches text names, in order,
// each once.
func namesIn(body string) (flags, faults []string) {
	body = strings.NewReplacer("`", "", `"`, "", "'", "").Replace(body)
	add := func(list *[]string, s string) {
		if !slices.Contains(*list, s) {
			*list = append(*list, s)
		}
	}
	for _, m := range flagRef.FindAllStringSubmatch(body, -1) {
		add(&flags, m[1])
	}
	for _, m := range faultRef.FindAllStringSubmatch(body, -1) {
		for _, name := range kebabWord.FindAllString(m[1], -1) {
			add(&faults, name)
		}
	}
	for _, re := range []*regexp.Regexp{faultBefore, typeSwitch} {
		for _, m := range re.FindAllStringSubmatch(body, -1) {
			add(&faults, m[1])
		}
	}
	return flags, faults
}

// nameViolations returns one line per flag or fault switch that a text
// names and that does not exist.
func nameViolations(texts []text, faultExists func(string) bool, flags map[string]bool) []string {
	var out []string
	for _, tx := range texts {
		fl, fs := namesIn(tx.body)
		for _, f := range fl {
			if !flags[f] {
				out = append(out, fmt.Sprintf("%s names the flag --%s, which neither pdserve nor pdctl has", tx.where, f))
			}
		}
		for _, f := range fs {
			if !faultExists(f) {
				out = append(out, fmt.Sprintf("%s names the fault switch %s, which the fault registry (engine/serve) does not have", tx.where, f))
			}
		}
	}
	return out
}

// faultExists reports whether the engine's registry has fault name.
func faultExists(name string) bool {
	_, ok := serve.FaultRoles(name)
	return ok
}

// buildFlags are go build's flags for the tools: -race when this test is
// built with it (race_test.go), so that the build reuses the packages "go
// test -race" compiled.
var buildFlags []string

// buildTools builds pdserve and pdctl into a temporary directory and
// returns their paths.
func buildTools(t *testing.T, root string) []string {
	t.Helper()
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	dir := t.TempDir()
	args := append([]string{"build"}, buildFlags...)
	args = append(args, "-o", dir+string(filepath.Separator), "./cmd/pdserve", "./cmd/pdctl")
	cmd := exec.CommandContext(t.Context(), goCmd, args...)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pdserve ./cmd/pdctl: %v\n%s", err, out)
	}
	return []string{filepath.Join(dir, "pdserve"), filepath.Join(dir, "pdctl")}
}

// flagLine is a flag's line in a help's Flags or Global Flags section.
var flagLine = regexp.MustCompile(`^\s*(?:-[A-Za-z0-9], )?--([a-z0-9][a-z0-9-]*)`)

// walkHelp reads "bin args... --help" and, recursively, the help of every
// subcommand it lists (cobra's help and completion aside): each as one text,
// with the flags its Flags and Global Flags sections list added to flags.
// The help of a command holds its Long (or Short) text, its Example, its
// flags' usages and its subcommands' Short texts. Each command walked is
// added to cmds as its path ("pdctl fault off").
func walkHelp(t *testing.T, bin string, args []string, texts *[]text, flags, cmds map[string]bool) {
	t.Helper()
	cmds[strings.Join(append([]string{filepath.Base(bin)}, args...), " ")] = true
	cmd := exec.CommandContext(t.Context(), bin, append(slices.Clone(args), "--help")...)
	cmd.Env = []string{"HOME=" + t.TempDir()} // no PD_* or PDCTL_* from the caller
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s --help: %v", filepath.Base(bin), strings.Join(args, " "), err)
	}
	where := strings.TrimSpace(filepath.Base(bin)+" "+strings.Join(args, " ")) + " --help"
	*texts = append(*texts, text{where: where, body: string(out)})
	var subs []string
	sections := helptest.Sections(string(out))
	for _, line := range sections["Available Commands"] {
		// cobra's own commands: help, and completion, whose texts are
		// cobra's and name other tools' flags (brew --prefix).
		if f := strings.Fields(line); len(f) > 0 && f[0] != "help" && f[0] != "completion" {
			subs = append(subs, f[0])
		}
	}
	for _, line := range append(sections["Flags"], sections["Global Flags"]...) {
		if m := flagLine.FindStringSubmatch(line); m != nil {
			flags[m[1]] = true
		}
	}
	for _, s := range subs {
		walkHelp(t, bin, append(slices.Clone(args), s), texts, flags, cmds)
	}
}

// diagTexts returns every rule's doc, and the summary and remedy of every
// finding the rules give on the fixtures of diag/testdata (each rule has a
// sick fixture there, which the diag tests enforce).
func diagTexts(t *testing.T, root string) []text {
	t.Helper()
	var out []text
	for _, r := range diag.Rules() {
		out = append(out, text{where: "diag rule " + r.Name + " doc", body: r.Doc})
	}
	fixtures, err := filepath.Glob(filepath.Join(root, "diag", "testdata", "*", "*.json"))
	if err != nil || len(fixtures) == 0 {
		t.Fatalf("no diag fixtures (%v)", err)
	}
	seen := map[string]bool{}
	for _, fx := range fixtures {
		data, err := os.ReadFile(fx)
		if err != nil {
			t.Fatal(err)
		}
		var w diag.Window
		if err := json.Unmarshal(data, &w); err != nil {
			t.Fatalf("%s: %v", fx, err)
		}
		rel, _ := filepath.Rel(root, fx)
		for _, f := range diag.Run(w) {
			for _, tx := range []text{{"summary", f.Summary}, {"remedy", f.Remedy}} {
				if !seen[tx.body] {
					seen[tx.body] = true
					out = append(out, text{where: fmt.Sprintf("diag rule %s %s (on %s)", f.Rule, tx.where, rel), body: tx.body})
				}
			}
		}
	}
	return out
}

// TestNamesExist fails on a help text of pdserve or pdctl, or a diag rule's
// doc, summary or remedy, that names a fault switch or a flag that does
// not exist.
func TestNamesExist(t *testing.T) {
	root, _ := moduleRoot(t)
	var texts []text
	flags, cmds := map[string]bool{}, map[string]bool{}
	for _, bin := range buildTools(t, root) {
		walkHelp(t, bin, nil, &texts, flags, cmds)
	}
	if len(texts) < 20 || !flags["fault"] || !flags["server"] || !flags["transfer-timeout"] || !cmds["pdctl fault off"] || !cmds["pdctl bundle"] {
		t.Fatalf("read %d help texts, the flags %v and the commands %v: the help walk is broken", len(texts), flags, cmds)
	}
	diagTx := diagTexts(t, root)
	texts = append(texts, diagTx...)
	for _, v := range nameViolations(texts, faultExists, flags) {
		t.Error(v)
	}
	// In the diag texts "pdctl" is always the command an operator types
	// (help texts also use the name in prose: "pdctl attaches to ...").
	for _, v := range commandViolations(diagTx, cmds) {
		t.Error(v)
	}
}

// pdctlRef is "pdctl" followed by the words that may name its command and
// subcommand ("pdctl fault off stall-last-rank"): lowercase words, up to
// the first flag or other token.
var pdctlRef = regexp.MustCompile(`\bpdctl((?: [a-z][a-z0-9-]*)+)`)

// commandViolations returns one line per pdctl command a text names that
// pdctl does not have: the word after "pdctl" must be one of its commands,
// and the word after a command that has subcommands one of those (cmds
// holds every command path, "pdctl", "pdctl fault", "pdctl fault off").
// Words after a command without subcommands are its arguments.
func commandViolations(texts []text, cmds map[string]bool) []string {
	hasSubs := func(path string) bool {
		for c := range cmds {
			if strings.HasPrefix(c, path+" ") {
				return true
			}
		}
		return false
	}
	var out []string
	for _, tx := range texts {
		body := strings.NewReplacer("`", "", `"`, "", "'", "").Replace(tx.body)
		seen := map[string]bool{}
		for _, m := range pdctlRef.FindAllStringSubmatch(body, -1) {
			path := "pdctl"
			for _, w := range strings.Fields(m[1]) {
				if !hasSubs(path) {
					break
				}
				path += " " + w
				if !cmds[path] {
					if !seen[path] {
						seen[path] = true
						out = append(out, fmt.Sprintf("%s names the command %s, which pdctl does not have", tx.where, path))
					}
					break
				}
			}
			if cmds[path] && hasSubs(path) && path != "pdctl" && !seen[path] {
				seen[path] = true
				out = append(out, fmt.Sprintf("%s names %s without one of its commands", tx.where, path))
			}
		}
	}
	return out
}

// TestCommandViolations checks the check: pdctl commands that exist pass,
// with their arguments and flags; a command or subcommand that does not
// exist, or a command that needs a subcommand named without one, is
// caught.
func TestCommandViolations(t *testing.T) {
	cmds := map[string]bool{"pdctl": true, "pdctl bundle": true, "pdctl fault": true, "pdctl fault on": true,
		"pdctl fault off": true, "pdctl status": true, "pdctl diagnose": true}
	texts := []text{
		{"ok remedy", "switch it off (pdctl fault off stall-last-rank --server http://x); keep a bundle (pdctl bundle -o FILE.tar.gz); " +
			"pdctl status shows each server; run pdctl diagnose --canaries again"},
		{"stale remedy", "run pdctl restart, then pdctl fault reset stall-last-rank"},
		{"half a command", "switch it (pdctl fault stall-last-rank)"},
		{"bare", "pdctl fault"},
	}
	got := commandViolations(texts, cmds)
	want := []string{
		"stale remedy names the command pdctl restart, which pdctl does not have",
		"stale remedy names the command pdctl fault reset, which pdctl does not have",
		"half a command names the command pdctl fault stall-last-rank, which pdctl does not have",
		"bare names pdctl fault without one of its commands",
	}
	if !slices.Equal(got, want) {
		t.Errorf("violations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestNameViolations checks the check: names of switches and flags that do
// not exist are caught, in every form the texts use, and those that exist
// pass.
func TestNameViolations(t *testing.T) {
	flags := map[string]bool{"server": true, "fault": true, "rooms-from-queue": true, "prefill": true}
	texts := []text{
		{"ok remedy", "unless a drill needs it, switch it off (pdctl fault off bootstrap-abort-crash --server http://x); " +
			"a server started with --fault keeps it; abort the rooms (pdctl abort --prefill/--rooms-from-queue)"},
		{"ok doc", "a fault switch such as stall-last-rank holds a rank; the faults drop-kv-chunk and delay-heartbeat; " +
			"the fault-switch-on rule; the fault switch on: pd-loop-exit; a rank-divergence finding; the mass-abort drill; " +
			"pdctl fault on hicache-indexk-ungated"},
		{"stale remedy", "switch off the faults overlap-local-decisions and stall-last-rank if one is on (fault-switch-on), " +
			"restart the server and run it with the lock-step (non-overlap) loop"},
		{"stale help", "turn it on with `pdctl fault on hicache-indexk-unguarded` or --fault=made-up-switch, see its `no-such` fault"},
		{"stale flags", "run pdserve decode --no-such-flag, or pdctl diagnose --overlap"},
		{"stale type switch", "drop-kv-chunks is dropped"},
	}
	got := nameViolations(texts, faultExists, flags)
	want := []string{
		"stale remedy names the fault switch overlap-local-decisions, which the fault registry (engine/serve) does not have",
		"stale help names the fault switch hicache-indexk-unguarded, which the fault registry (engine/serve) does not have",
		"stale help names the fault switch made-up-switch, which the fault registry (engine/serve) does not have",
		"stale help names the fault switch no-such, which the fault registry (engine/serve) does not have",
		"stale flags names the flag --no-such-flag, which neither pdserve nor pdctl has",
		"stale flags names the flag --overlap, which neither pdserve nor pdctl has",
		"stale type switch names the fault switch drop-kv-chunks, which the fault registry (engine/serve) does not have",
	}
	if !slices.Equal(got, want) {
		t.Errorf("violations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
