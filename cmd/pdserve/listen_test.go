package main

import (
	"net"
	"strconv"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// TestPortTaken: a taken port is named with the flag that chooses another
// (and, for launch, how through make run), at once, without a retry.
func TestPortTaken(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"launch", "--port", port}, []string{"port " + port + " is taken", "--port N", `make run ARGS="--port 8001"`}},
		{[]string{"router", "--port", port, "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"}, []string{"port " + port + " is taken", "--port N"}},
		{[]string{"serve", "--port", port, "--model", path, "--threads", "1"}, []string{"port " + port + " is taken", "--port N"}},
		{[]string{"prefill", "--port", "0", "--bootstrap-port", port, "--model", path, "--threads", "1"}, []string{"port " + port + " is taken", "--bootstrap-port N"}},
	} {
		_, stderr, code := run(t, tc.args...)
		if code != 1 || strings.Contains(stderr, "retrying") {
			t.Errorf("%v: exit %d: %s", tc.args, code, stderr)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%v: %q lacks %q", tc.args, stderr, w)
			}
		}
	}
}
