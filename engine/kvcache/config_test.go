package kvcache

import (
	"math"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/kernels"
)

func goodConfig() Config {
	return Config{
		Layers:     2,
		KVDim:      8,
		PageSize:   4,
		Pages:      16,
		IndexK:     &IndexKConfig{DType: kernels.IndexFP8, Dim: 4},
		MaxSeqs:    4,
		MaxContext: 32,
	}
}

func TestValidateRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(c *Config)
		want string // in the error
	}{
		{"zero layers", func(c *Config) { c.Layers = 0 }, "Layers"},
		{"negative KVDim", func(c *Config) { c.KVDim = -8 }, "KVDim"},
		{"zero page size", func(c *Config) { c.PageSize = 0 }, "PageSize"},
		{"page size too big", func(c *Config) { c.PageSize = MaxPageSize + 1 }, "PageSize"},
		{"zero pages", func(c *Config) { c.Pages = 0 }, "Pages"},
		{"zero rows", func(c *Config) { c.MaxSeqs = 0 }, "MaxSeqs"},
		{"zero context", func(c *Config) { c.MaxContext = 0 }, "MaxContext"},
		{"context not coverable", func(c *Config) { c.MaxContext = 65 }, "MaxContext 65"},
		{"index dim zero", func(c *Config) { c.IndexK.Dim = 0 }, "IndexK.Dim"},
		{"index dtype unknown", func(c *Config) { c.IndexK.DType = 9 }, "IndexK.DType"},
		{"slots beyond int32", func(c *Config) { c.Pages, c.PageSize = 1<<20, 4096 }, "slots"},
		{"pages*pagesize overflows int", func(c *Config) { c.Pages, c.PageSize = math.MaxInt/2, 4096 }, "slots"},
		{"KV length overflows", func(c *Config) { c.KVDim = math.MaxInt / 8 }, "K/V length"},
		{"total bytes overflow", func(c *Config) {
			c.Pages, c.PageSize, c.MaxContext, c.KVDim, c.Layers = 1<<18, 4096, 1, 1<<20, 1<<20
		}, "total bytes"},
		{"index length overflows", func(c *Config) { c.IndexK.Dim = math.MaxInt / 4 }, "index-K length"},
		{"table overflows", func(c *Config) { c.MaxSeqs = math.MaxInt / 2 }, "request-to-token table"},
	} {
		c := goodConfig()
		ik := *c.IndexK
		c.IndexK = &ik
		tc.edit(&c)
		err := c.Validate()
		if err == nil {
			t.Errorf("%s: Validate accepted %+v", tc.name, c)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %q does not mention %q", tc.name, err, tc.want)
		}
		if _, err := NewPool(c); err == nil {
			t.Errorf("%s: NewPool accepted it", tc.name)
		}
	}
}

func TestValidateReportsEveryProblem(t *testing.T) {
	err := Config{PageSize: 1}.Validate()
	if err == nil {
		t.Fatal("zero config accepted")
	}
	for _, f := range []string{"Layers", "KVDim", "Pages", "MaxSeqs", "MaxContext"} {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error %q does not mention %s", err, f)
		}
	}
}

func TestValidateAccepts(t *testing.T) {
	for _, c := range []Config{
		goodConfig(),
		{Layers: 1, KVDim: 1, PageSize: 1, Pages: 1, MaxSeqs: 1, MaxContext: 1},
		{Layers: 1, KVDim: 1, PageSize: MaxPageSize, Pages: 1, MaxSeqs: 1, MaxContext: MaxPageSize},
		// The brief's example pool, sized but not allocated here.
		{Layers: 6, KVDim: 288, PageSize: 16, Pages: 512, MaxSeqs: 64, MaxContext: 8192,
			IndexK: &IndexKConfig{DType: kernels.IndexBF16, Dim: 64}},
	} {
		if err := c.Validate(); err != nil {
			t.Errorf("Validate(%+v): %v", c, err)
		}
	}
}

func TestBytes(t *testing.T) {
	for _, tc := range []struct {
		ik   *IndexKConfig
		want int64
	}{
		// 2 layers × 64 slots × (K+V 8 float32 = 64 B) = 8192 B, plus index keys.
		{nil, 8192},
		{&IndexKConfig{DType: kernels.IndexFP8, Dim: 4}, 8192 + 2*64*(4+4)},
		{&IndexKConfig{DType: kernels.IndexBF16, Dim: 4}, 8192 + 2*64*4*2},
	} {
		c := goodConfig()
		c.IndexK = tc.ik
		p, err := NewPool(c)
		if err != nil {
			t.Fatal(err)
		}
		if p.Bytes() != tc.want {
			t.Errorf("IndexK %+v: Bytes %d, want %d", tc.ik, p.Bytes(), tc.want)
		}
		var held int64
		for l := range c.Layers {
			held += 4 * int64(len(p.K(l))+len(p.V(l)))
			if ik := p.IndexKeys(l); ik != nil {
				held += int64(len(ik.FP8)) + 4*int64(len(ik.Scales)) + 2*int64(len(ik.BF16))
			} else if tc.ik != nil {
				t.Fatalf("layer %d has no index keys", l)
			}
		}
		if held != tc.want {
			t.Errorf("IndexK %+v: arrays hold %d bytes, Bytes says %d", tc.ik, held, tc.want)
		}
		if p.TableBytes() != 4*4*32 {
			t.Errorf("TableBytes %d", p.TableBytes())
		}
	}
}

func TestConfigIsACopy(t *testing.T) {
	c := goodConfig()
	p, err := NewPool(c)
	if err != nil {
		t.Fatal(err)
	}
	c.IndexK.Dim = 99
	got := p.Config()
	got.IndexK.Dim = 77
	if d := p.Config().IndexK.Dim; d != 4 {
		t.Fatalf("pool's IndexK.Dim changed to %d", d)
	}
}
