package main

import (
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/kernels"
)

// --kv-memory takes bytes or a share and is refused with --kv-tokens, or
// when it is no budget, on every engine command.
func TestKVMemoryFlag(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	for _, role := range []string{"serve", "prefill", "decode"} {
		for _, c := range []struct {
			args []string
			msg  string
		}{
			{[]string{"--kv-memory", "1GiB", "--kv-tokens", "64"}, "--kv-tokens and --kv-memory both size the KV pool: give one"},
			{[]string{"--kv-memory", "1.5"}, `"1.5" is not a share of memory`},
			{[]string{"--kv-memory", "150%"}, `"150%" is not a share of memory`},
			{[]string{"--kv-memory", "lots"}, `"lots" is not a size`},
			{[]string{"--kv-memory", "100"}, "a KV memory of 100 bytes (--kv-memory) holds no page of 16 tokens on each of 1 ranks"},
		} {
			args := append([]string{role, "--model", path, "--port", "0", "--threads", "1"}, c.args...)
			if _, stderr, code := run(t, args...); code != 2 || !strings.Contains(stderr, c.msg) {
				t.Errorf("%v: exit %d, %q; want 2 and %q", args, code, stderr, c.msg)
			}
		}
	}
}
