// Package config gives every command-line setting of pdkit's commands the
// same three sources, in order of precedence: the flag, a PD_* environment
// variable named after it, and its default. Flags carry the doc strings, so
// one FlagSet describes a command's whole configuration, and Effective
// reports where each value came from (`pdserve config`).
package config

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/spf13/pflag"
)

// EnvPrefix starts every environment variable pdkit reads for a setting.
const EnvPrefix = "PD_"

// skip lists flags that are not settings (help, version).
var skip = map[string]bool{"help": true, "version": true}

// EnvName is the environment variable of a flag: "max-tokens" → "PD_MAX_TOKENS".
func EnvName(flag string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// AnnotateUsage appends each flag's environment variable to its usage text,
// so --help documents both.
func AnnotateUsage(fs *pflag.FlagSet) {
	fs.VisitAll(func(f *pflag.Flag) {
		if skip[f.Name] || strings.Contains(f.Usage, EnvPrefix) {
			return
		}
		f.Usage += " [$" + EnvName(f.Name) + "]"
	})
}

// ApplyEnv sets every flag that was not given on the command line from its
// environment variable, when that is set. A value the flag refuses is an
// error naming the variable.
func ApplyEnv(fs *pflag.FlagSet, getenv func(string) string) error {
	var err error
	fs.VisitAll(func(f *pflag.Flag) {
		if err != nil || skip[f.Name] || f.Changed {
			return
		}
		env := EnvName(f.Name)
		v := getenv(env)
		if v == "" {
			return
		}
		if e := fs.Set(f.Name, v); e != nil {
			err = fmt.Errorf("%s=%q: %w", env, v, e)
			return
		}
		f.Changed = false // given by the environment, not the command line
		err = fs.SetAnnotation(f.Name, sourceAnnotation, []string{"env"})
	})
	return err
}

// sourceAnnotation marks, on a flag, that ApplyEnv set it.
const sourceAnnotation = "pdkit.source"

// Entry is one setting's effective value.
type Entry struct {
	Name    string `json:"name"`
	Env     string `json:"env"`
	Value   string `json:"value"`
	Default string `json:"default"`
	Source  string `json:"source"` // "flag", "env" or "default"
	Doc     string `json:"doc"`
}

// Effective lists every setting of fs with its value and where it came from.
func Effective(fs *pflag.FlagSet) []Entry {
	var out []Entry
	fs.VisitAll(func(f *pflag.Flag) {
		if skip[f.Name] {
			return
		}
		src := "default"
		switch {
		case f.Changed:
			src = "flag"
		case len(f.Annotations[sourceAnnotation]) > 0:
			src = "env"
		}
		doc, _, _ := strings.Cut(f.Usage, " [$")
		out = append(out, Entry{Name: f.Name, Env: EnvName(f.Name), Value: f.Value.String(), Default: f.DefValue, Source: src, Doc: doc})
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Print writes entries as a table.
func Print(w io.Writer, entries []Entry) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SETTING\tVALUE\tSOURCE\tENV\tDOC")
	for _, e := range entries {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", e.Name, e.Value, e.Source, e.Env, e.Doc)
	}
	return tw.Flush()
}
