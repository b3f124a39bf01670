package main

import (
	"bytes"
	"testing"
)

// TestNewCmdVersion checks the options that "pdctl version" parses from argv.
func TestNewCmdVersion(t *testing.T) {
	tests := []struct {
		args []string
		want versionOptions
	}{
		{args: nil, want: versionOptions{Build: testBuild}},
		{args: []string{"--json"}, want: versionOptions{Build: testBuild, JSON: true}},
		{args: []string{"--json=false"}, want: versionOptions{Build: testBuild}},
	}
	for _, tt := range tests {
		f := &factory{Out: &bytes.Buffer{}, ErrOut: &bytes.Buffer{}, Build: testBuild}
		var got *versionOptions
		cmd := newCmdVersion(f, func(o *versionOptions) error { got = o; return nil })
		cmd.SetArgs(tt.args)
		if err := cmd.Execute(); err != nil {
			t.Fatalf("version %q: %v", tt.args, err)
		}
		if got.Build != tt.want.Build || got.JSON != tt.want.JSON {
			t.Errorf("version %q: options %+v, want %+v", tt.args, *got, tt.want)
		}
	}
}
