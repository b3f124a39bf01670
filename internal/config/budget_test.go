package config

import "testing"

func TestBudget(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want Budget
		of   int64 // out of 8 GiB
		str  string
	}{
		{"2GiB", Budget{Bytes: 2 << 30}, 2 << 30, "2GiB"},
		{"1073741824", Budget{Bytes: 1 << 30}, 1 << 30, "1GiB"},
		{"0.25", Budget{Fraction: 0.25}, 2 << 30, "25%"},
		{"50%", Budget{Fraction: 0.5}, 4 << 30, "50%"},
		{"1.0", Budget{Fraction: 1}, 8 << 30, "100%"},
	} {
		var b Budget
		if err := b.Set(tt.in); err != nil {
			t.Fatalf("%q: %v", tt.in, err)
		}
		if b != tt.want || b.Of(8<<30) != tt.of || b.String() != tt.str {
			t.Errorf("%q: %+v, of 8GiB %d, string %q; want %+v, %d, %q", tt.in, b, b.Of(8<<30), b.String(), tt.want, tt.of, tt.str)
		}
		var again Budget // what String writes, Set reads back (launch hands it on)
		if err := again.Set(b.String()); err != nil || again != b {
			t.Errorf("%q: %q reads back as %+v, %v", tt.in, b.String(), again, err)
		}
	}
	for _, bad := range []string{"", "1.5", "0.0", "-0.2", "0%", "150%", "2 parsecs", "x%"} {
		var b Budget
		if err := b.Set(bad); err == nil {
			t.Errorf("%q accepted as %+v", bad, b)
		}
	}
}
