package bench

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
)

// TestRunPDTiny runs the PD benchmark end to end on the tiny model: a
// colocated engine and a prefill+decode pair over real sockets, then the
// transport comparison. It checks the structure of the figures, never
// their speed.
func TestRunPDTiny(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cfg := PDConfig{
		Home: t.TempDir(), Arch: model.ArchLlama, Size: builtin.SizeTiny, Threads: 1,
		Prompts: []int{16, 64}, Requests: 2, MaxTokens: 4, TransportTime: 200 * time.Millisecond, TransportTokens: 64,
	}
	rep, err := RunPD(ctx, cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Config.TP != 1 {
		t.Errorf("TP default %d, want 1", rep.Config.TP)
	}
	if len(rep.Lengths) != len(cfg.Prompts) {
		t.Fatalf("%d prompt lengths, want %d", len(rep.Lengths), len(cfg.Prompts))
	}
	if want := len(cfg.Prompts) * cfg.Requests; rep.Compared != want {
		t.Errorf("%d requests compared with colocated, want %d", rep.Compared, want)
	}
	mc := rep.Model
	perTok := uint64(mc.Layers * 2 * mc.KVHeads * mc.HeadDim * 4) // F32 K and V, llama has no index-K
	for i, l := range rep.Lengths {
		if l.PromptLen != cfg.Prompts[i] || l.Requests != cfg.Requests {
			t.Errorf("length %d: %+v", i, l)
		}
		if !(l.ColP50 > 0 && l.PDP50 > 0 && l.Ratio() > 0 && l.KVRate > 0) {
			t.Errorf("%d tokens: a non-positive figure: %+v", l.PromptLen, l)
		}
		if l.ColP50 > l.ColP99 || l.PDP50 > l.PDP99 {
			t.Errorf("%d tokens: percentiles out of order: %+v", l.PromptLen, l)
		}
		if want := perTok * uint64(l.PromptLen); l.KVBytes != want {
			t.Errorf("%d tokens: %d KV bytes per request, want %d", l.PromptLen, l.KVBytes, want)
		}
	}
	tr := rep.Transport
	if want := int(perTok) * cfg.TransportTokens; tr.MsgBytes != want {
		t.Errorf("transport message of %d bytes, want %d", tr.MsgBytes, want)
	}
	if tr.Messages < 1 || tr.Bytes != uint64(tr.Messages)*uint64(tr.MsgBytes) {
		t.Errorf("transport moved %d bytes in %d messages of %d", tr.Bytes, tr.Messages, tr.MsgBytes)
	}
	if !(tr.ZMQ > 0 && tr.Raw > 0 && tr.Ratio() > 0 && tr.ZMQElapsed > 0 && tr.RawElapsed > 0 &&
		tr.Plain > 0 && tr.PlainMessages >= transportRounds && tr.PlainElapsed > 0 && tr.AuthRatio() > 0 &&
		len(tr.AuthRounds) == transportRounds && tr.AuthBound() > 0) {
		t.Errorf("a non-positive transport figure: %+v", tr)
	}
	checkReport(t, rep.Print, "PD/colocated", "ZeroMQ KV_CHUNK", "ZeroMQ KV_CHUNK, PLAIN", "raw TCP", "goal ≥ 0.8", "ratio PLAIN / no authentication", "95% bound", "the bound ≥ 0.9", "KV path", "zero-copy cgo shim", "control messages use pebbe/zmq4")
}

// A prompt longer than the context is refused before anything starts.
func TestRunPDRefusesLongPrompt(t *testing.T) {
	_, err := RunPD(t.Context(), PDConfig{Home: t.TempDir(), Size: builtin.SizeTiny, Prompts: []int{600}}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "context length") {
		t.Errorf("got %v, want a context length error", err)
	}
}
