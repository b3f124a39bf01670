package pdproto

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

func bsRank(rank, tp int) RankInfo {
	return RankInfo{
		Rank: rank, TPSize: tp, Endpoint: "tcp://127.0.0.1:5555",
		PageSize: 16, KVDType: "bf16", IndexKDType: "fp8", Model: "m@sha256:ab",
		Layers: 4, KVHeads: 2, HeadDim: 64,
		InstanceID: "i-1", StartedAt: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC),
	}
}

func bsGroup(tp int) []RankInfo {
	var g []RankInfo
	for r := range tp {
		g = append(g, bsRank(r, tp))
	}
	return g
}

func bsDecode(tp int) DecodeInfo {
	return DecodeInfo{TPSize: tp, PageSize: 16, KVDType: "bf16", IndexKDType: "fp8",
		Model: "m@sha256:ab", Layers: 4, KVHeads: 2, HeadDim: 64}
}

func TestRankInfoJSON(t *testing.T) {
	r := bsRank(1, 2)
	b, err := json.Marshal(RegisterRequest{r})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{`"rank":1`, `"tp_size":2`, `"endpoint":`, `"page_size":16`, `"kv_dtype":"bf16"`,
		`"index_k_dtype":"fp8"`, `"model":`, `"layers":4`, `"kv_heads":2`, `"head_dim":64`, `"instance_id":"i-1"`, `"started_at":`} {
		if !strings.Contains(string(b), k) {
			t.Errorf("%s lacks %s", b, k)
		}
	}
	var back RegisterRequest
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !back.RankInfo.Same(r) {
		t.Errorf("round trip: %+v != %+v", back.RankInfo, r)
	}
}

func TestRankInfoValidate(t *testing.T) {
	long := strings.Repeat("x", MaxRankInfoString+1)
	for _, tc := range []struct {
		field string
		edit  func(*RankInfo)
	}{
		{"", func(*RankInfo) {}},
		{"", func(r *RankInfo) { r.IndexKDType = "" }},
		{"tp_size", func(r *RankInfo) { r.TPSize = 0 }},
		{"tp_size", func(r *RankInfo) { r.TPSize = MaxTPSize + 1 }},
		{"rank", func(r *RankInfo) { r.Rank = 2 }},
		{"rank", func(r *RankInfo) { r.Rank = -1 }},
		{"page_size", func(r *RankInfo) { r.PageSize = 0 }},
		{"layers", func(r *RankInfo) { r.Layers = -3 }},
		{"kv_heads", func(r *RankInfo) { r.KVHeads = 0 }},
		{"head_dim", func(r *RankInfo) { r.HeadDim = 0 }},
		{"started_at", func(r *RankInfo) { r.StartedAt = time.Time{} }},
		{"endpoint", func(r *RankInfo) { r.Endpoint = "" }},
		{"endpoint", func(r *RankInfo) { r.Endpoint = "127.0.0.1:5555" }},
		{"endpoint", func(r *RankInfo) { r.Endpoint = "tcp://" }},
		{"kv_dtype", func(r *RankInfo) { r.KVDType = "" }},
		{"model", func(r *RankInfo) { r.Model = long }},
		{"instance_id", func(r *RankInfo) { r.InstanceID = "" }},
	} {
		r := bsRank(1, 2)
		tc.edit(&r)
		err := r.Validate()
		if tc.field == "" {
			if err != nil {
				t.Errorf("%+v: %v", r, err)
			}
			continue
		}
		var be *BootstrapError
		if !errors.As(err, &be) || be.Field != tc.field || be.Status != 400 || be.Code != CodeInvalidRequest {
			t.Errorf("want a 400 on %s, got %v", tc.field, err)
		}
	}
}

func TestCheckCompatible(t *testing.T) {
	for _, tc := range []struct {
		name   string
		local  func(*DecodeInfo)
		remote func([]RankInfo) []RankInfo
		field  string // "" means compatible
		rank   int
		want   string // substring of the message
	}{
		{name: "same", field: ""},
		{name: "tp1", local: func(d *DecodeInfo) { d.TPSize = 1 }, remote: func([]RankInfo) []RankInfo { return bsGroup(1) }},
		{name: "no indexer", local: func(d *DecodeInfo) { d.IndexKDType = "" },
			remote: func(g []RankInfo) []RankInfo {
				for i := range g {
					g[i].IndexKDType = ""
				}
				return g
			}},
		{name: "tp differs", local: func(d *DecodeInfo) { d.TPSize = 4 }, field: "tp_size", rank: -1,
			want: "different TP sizes on prefill and decode are not supported yet"},
		{name: "empty", remote: func([]RankInfo) []RankInfo { return nil }, field: "ranks", rank: -1, want: "no prefill ranks"},
		{name: "missing rank", remote: func(g []RankInfo) []RankInfo { return g[:1] }, field: "ranks", rank: -1},
		{name: "duplicate rank", remote: func(g []RankInfo) []RankInfo { g[1].Rank = 0; return g }, field: "ranks", rank: -1},
		{name: "tp disagree", remote: func(g []RankInfo) []RankInfo { g[1].TPSize = 3; return g }, field: "ranks", rank: -1},
		{name: "page size", local: func(d *DecodeInfo) { d.PageSize = 32 }, field: "page_size", rank: 0,
			want: "prefill rank 0 has page_size 16, decode has 32"},
		{name: "kv dtype", remote: func(g []RankInfo) []RankInfo { g[1].KVDType = "f16"; return g }, field: "kv_dtype", rank: 1,
			want: `kv_dtype "f16", decode has "bf16"`},
		{name: "index-k dtype", local: func(d *DecodeInfo) { d.IndexKDType = "bf16" }, field: "index_k_dtype", rank: 0},
		{name: "index-k absent", local: func(d *DecodeInfo) { d.IndexKDType = "" }, field: "index_k_dtype", rank: 0,
			want: `decode has ""`},
		{name: "model", local: func(d *DecodeInfo) { d.Model = "other" }, field: "model", rank: 0},
		{name: "layers", local: func(d *DecodeInfo) { d.Layers = 5 }, field: "layers", rank: 0},
		{name: "kv heads", remote: func(g []RankInfo) []RankInfo { g[1].KVHeads = 4; return g }, field: "kv_heads", rank: 1},
		{name: "head dim", local: func(d *DecodeInfo) { d.HeadDim = 128 }, field: "head_dim", rank: 0},
		{name: "first field wins", local: func(d *DecodeInfo) { d.HeadDim = 128; d.PageSize = 8 }, field: "page_size", rank: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			local := bsDecode(2)
			if tc.local != nil {
				tc.local(&local)
			}
			remote := bsGroup(2)
			if tc.remote != nil {
				remote = tc.remote(remote)
			}
			err := CheckCompatible(local, remote)
			if tc.field == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			var ie *IncompatibleError
			if !errors.As(err, &ie) || !errors.Is(err, ErrIncompatible) {
				t.Fatalf("want an *IncompatibleError, got %v", err)
			}
			if ie.Field != tc.field || ie.Rank != tc.rank {
				t.Errorf("field %s rank %d, want %s rank %d: %v", ie.Field, ie.Rank, tc.field, tc.rank, err)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.field) {
				t.Errorf("message %q lacks %q or %q", err, tc.want, tc.field)
			}
		})
	}
}

func TestBootstrapErrorJSON(t *testing.T) {
	e := &BootstrapError{Status: 503, Code: CodeNotReady, Message: "1 of 2", Registered: 1, TPSize: 2, Missing: []int{1}}
	b, err := json.Marshal(BootstrapErrorBody{*e})
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"error":{"code":"not_ready","message":"1 of 2","registered":1,"tp_size":2,"missing":[1]}}`
	if string(b) != want {
		t.Errorf("got %s, want %s", b, want)
	}
	if !strings.Contains(e.Error(), "503 not_ready") {
		t.Errorf("Error() = %q", e.Error())
	}
}
