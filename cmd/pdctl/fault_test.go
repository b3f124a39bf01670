package main

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/server"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

const faultDoc = "the prefill control loop treats ABORT as an unknown message and exits (the mass-abort wedge)"

// TestFault switches a fault on and off through pdctl and lists it; the
// steps run in order on one cluster.
func TestFault(t *testing.T) {
	c := newCluster(t)
	// Every switch the engine has, as fault list shows it on each server.
	var all string
	var names []string
	for _, n := range []*node{c.prefill, c.decode} {
		role := n.eng.Config().Role
		for _, fl := range n.eng.View().Faults() {
			state := "off"
			if !slices.Contains(fl.Roles, role) {
				state = "n/a"
			}
			server := map[*node]string{c.prefill: "PREFILL", c.decode: "DECODE"}[n]
			all += server + "\t" + role + "\t" + fl.Name + "\t" + state + "\t" + strings.Join(fl.Roles, ",") + "\t" + fl.Doc + "\n"
			if n == c.prefill {
				names = append(names, fl.Name)
			}
		}
	}
	unknown := "skipped: serve: unknown fault \"disk-full\" (known: [" + strings.Join(names, " ") + "])"
	steps := []struct {
		name   string
		args   []string
		code   exitCode
		stdout string
		stderr string
	}{
		{
			name:   "list, all off",
			args:   []string{"fault", "list"},
			stdout: all,
		},
		{
			name: "list one",
			args: []string{"fault", "list", "bootstrap-abort-crash"},
			stdout: "PREFILL\tprefill\tbootstrap-abort-crash\toff\tprefill\t" + faultDoc + "\n" +
				"DECODE\tdecode\tbootstrap-abort-crash\tn/a\tprefill\t" + faultDoc + "\n",
		},
		{
			name: "list those on: none",
			args: []string{"fault", "list", "--on"},
		},
		{
			name: "on: the decode is skipped",
			args: []string{"fault", "on", "bootstrap-abort-crash"},
			stdout: "PREFILL\tprefill\tbootstrap-abort-crash\ton\n" +
				"DECODE\tdecode\tbootstrap-abort-crash\tskipped: serve: fault \"bootstrap-abort-crash\" applies to [prefill] servers, this one is decode\n",
		},
		{
			name:   "list those on",
			args:   []string{"fault", "list", "--on"},
			stdout: "PREFILL\tprefill\tbootstrap-abort-crash\ton\tprefill\t" + faultDoc + "\n",
		},
		{
			name: "list json, on",
			args: []string{"--server", c.prefill.ts.URL, "fault", "list", "--json", "bootstrap-abort-crash"},
			stdout: `{
  "servers": [
    {
      "url": "PREFILL",
      "role": "prefill",
      "faults": [
        {
          "name": "bootstrap-abort-crash",
          "roles": [
            "prefill"
          ],
          "doc": "` + faultDoc + `",
          "on": true
        }
      ]
    }
  ]
}
`,
		},
		{
			name:   "off on one server",
			args:   []string{"--server", c.prefill.ts.URL, "fault", "off", "bootstrap-abort-crash"},
			stdout: "PREFILL\tprefill\tbootstrap-abort-crash\toff\n",
		},
		{
			name: "list with an unreachable server",
			args: []string{"--server", c.prefill.ts.URL, "--server", "http://127.0.0.1:1", "fault", "list", "bootstrap-abort-crash"},
			code: exitFindings,
			stdout: "PREFILL\tprefill\tbootstrap-abort-crash\toff\tprefill\t" + faultDoc + "\n" +
				"http://127.0.0.1:1\t-\t-\tunreachable: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\t-\t-\n",
			stderr: "pdctl: 1 server of 2 unreachable\n",
		},
		{
			name: "an unknown fault",
			args: []string{"fault", "on", "disk-full"},
			code: exitError,
			stdout: "PREFILL\tprefill\tdisk-full\t" + unknown + "\n" +
				"DECODE\tdecode\tdisk-full\t" + unknown + "\n",
			stderr: "pdctl: fault \"disk-full\" applies to none of the servers\n",
		},
		{
			name:   "list an unknown fault",
			args:   []string{"fault", "list", "disk-full"},
			code:   exitError,
			stderr: "pdctl: no server has a fault named \"disk-full\"\n",
		},
		{
			name:   "no name",
			args:   []string{"fault", "on"},
			code:   exitUsage,
			stderr: "pdctl: fault on takes one fault name, got []\nRun 'pdctl fault on --help' for usage.\n",
		},
		{
			name:   "no verb",
			args:   []string{"fault"},
			code:   exitUsage,
			stderr: "pdctl: fault needs a command: list, on or off\nRun 'pdctl fault --help' for usage.\n",
		},
	}
	for _, tt := range steps {
		code, stdout, stderr := c.pdctl(t, false, tt.args...)
		if code != tt.code {
			t.Errorf("%s: exit code = %d, want %d", tt.name, code, tt.code)
		}
		if stdout != tt.stdout {
			t.Errorf("%s: stdout:\n%s\nwant:\n%s", tt.name, stdout, tt.stdout)
		}
		if stderr != tt.stderr {
			t.Errorf("%s: stderr:\n%s\nwant:\n%s", tt.name, stderr, tt.stderr)
		}
	}
}

// TestFaultToken: the admin calls carry --token, else PDCTL_TOKEN; a
// server that refuses the call makes a row and exit status 1.
func TestFaultToken(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	n := newNode(t, m, serve.Config{PageSize: 4, KVTokens: 64}, server.Options{AdminToken: "s3cret"})
	skipped := n.ts.URL + "\tcolocated\tbootstrap-abort-crash\tskipped: serve: fault \"bootstrap-abort-crash\" applies to [prefill] servers, this one is colocated\n"
	for _, tt := range []struct {
		name   string
		env    string
		args   []string
		code   exitCode
		stdout string
		stderr string
	}{
		{name: "flag", args: []string{"--token", "s3cret"}, stdout: skipped, code: exitError,
			stderr: "pdctl: fault \"bootstrap-abort-crash\" applies to none of the servers\n"},
		{name: "env", env: "s3cret", stdout: skipped, code: exitError,
			stderr: "pdctl: fault \"bootstrap-abort-crash\" applies to none of the servers\n"},
		{name: "none", code: exitError,
			stdout: n.ts.URL + "\tcolocated\tbootstrap-abort-crash\trefused: " + n.ts.URL + "/admin/v1/faults/bootstrap-abort-crash/on: 401 admin API: missing bearer token (Authorization: Bearer <token>)\n",
			stderr: "pdctl: 1 server refused the switch\n"},
		{name: "wrong", args: []string{"--token", "guess"}, code: exitError,
			stdout: n.ts.URL + "\tcolocated\tbootstrap-abort-crash\trefused: " + n.ts.URL + "/admin/v1/faults/bootstrap-abort-crash/on: 401 admin API: wrong bearer token\n",
			stderr: "pdctl: 1 server refused the switch\n"},
	} {
		var out, errOut bytes.Buffer
		f := &factory{Out: &out, ErrOut: &errOut, Getenv: func(k string) string {
			if k == "PDCTL_TOKEN" {
				return tt.env
			}
			return ""
		}}
		args := append(append([]string{"--server", n.ts.URL}, tt.args...), "fault", "on", "bootstrap-abort-crash")
		code := run(t.Context(), f, args)
		if code != tt.code || out.String() != tt.stdout || errOut.String() != tt.stderr {
			t.Errorf("%s: exit %d, stdout:\n%s\nstderr:\n%s\nwant %d,\n%s\n%s", tt.name, code, out.String(), errOut.String(), tt.code, tt.stdout, tt.stderr)
		}
	}
}
