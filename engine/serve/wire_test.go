package serve

import (
	"errors"
	"reflect"
	"testing"

	"github.com/pdkit/pdkit/engine/rankcore"
	"github.com/pdkit/pdkit/kernels"
)

func TestWireRoundTrip(t *testing.T) {
	in := stepInput{now: 12345, stop: true,
		adds:   []addMsg{{id: 7, maxTokens: 9, ignoreEOS: true, prompt: []int32{1, 2, 3}, stop: []int32{4}, noCache: true, probe: true}, {id: 8, maxTokens: 1, prompt: []int32{5}, stop: []int32{}, pd: true, room: 1 << 60, url: "http://127.0.0.1:8998", tag: "trace-42"}},
		aborts: []abortMsg{{id: 7, by: AbortByClient}, {id: 99}},
		tier:   &tierOp{pages: 42}, switchIndexK: true, indexK: kernels.IndexBF16, indexKTier: 17, offload: []int32{9, 8, 7}}
	var got stepInput
	if err := got.decode(in.encode(nil)); err != nil || !reflect.DeepEqual(got, in) {
		t.Errorf("input: %v\n got %+v\nwant %+v", err, got, in)
	}
	out := stepOutput{now: 5, cuts: []abortMsg{{id: 3, by: AbortBySlowReader}}, toks: []rankcore.Sampled{{Tok: 11, Stop: false}, {Tok: 2, Stop: true}}}
	var gotOut stepOutput
	if err := gotOut.decode(out.encode(nil)); err != nil || !reflect.DeepEqual(gotOut, out) {
		t.Errorf("output: %v\n got %+v\nwant %+v", err, gotOut, out)
	}
	// Every truncation is refused, never a panic.
	b := in.encode(nil)
	for i := range len(b) {
		if err := got.decode(b[:i]); !errors.Is(err, errWire) {
			t.Fatalf("prefix %d of %d: %v", i, len(b), err)
		}
	}
	if err := got.decode(append(b, 0)); !errors.Is(err, errWire) {
		t.Errorf("trailing byte: %v", err)
	}
	// A request without a prompt cannot be admitted (admit matches all
	// but its last token): refused at the wire.
	empty := (&stepInput{adds: []addMsg{{id: 1, maxTokens: 2}}}).encode(nil)
	if err := got.decode(empty); !errors.Is(err, errWire) {
		t.Errorf("an add without a prompt: %v", err)
	}
}

func FuzzWireDecode(f *testing.F) {
	f.Add(((&stepInput{adds: []addMsg{{id: 1, maxTokens: 2, prompt: []int32{3}}}}).encode(nil)))
	f.Add((&stepOutput{cuts: []abortMsg{{id: 1}}, toks: []rankcore.Sampled{{Tok: 1}}}).encode(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		var in stepInput
		if in.decode(b) == nil {
			if again := in.encode(nil); string(again) != string(b) {
				t.Errorf("input re-encodes differently")
			}
		}
		var out stepOutput
		if out.decode(b) == nil {
			if again := out.encode(nil); string(again) != string(b) {
				t.Errorf("output re-encodes differently")
			}
		}
	})
}
