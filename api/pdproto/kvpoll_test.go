package pdproto

import "testing"

func TestKVPollString(t *testing.T) {
	for s, want := range map[KVPoll]string{
		Failed: "Failed", Bootstrapping: "Bootstrapping", WaitingForInput: "WaitingForInput",
		Transferring: "Transferring", Success: "Success", 5: "KVPoll(5)", 255: "KVPoll(255)",
	} {
		if got := s.String(); got != want {
			t.Errorf("KVPoll(%d).String() = %q, want %q", uint8(s), got, want)
		}
	}
	if Failed != 0 || Bootstrapping != 1 || WaitingForInput != 2 || Transferring != 3 || Success != 4 {
		t.Fatal("KVPoll values moved: the wire and the MIN reduction depend on them")
	}
}

func TestMerge(t *testing.T) {
	const bad = KVPoll(9)
	tests := []struct {
		old, new, want KVPoll
		why            string
	}{
		{Bootstrapping, WaitingForInput, WaitingForInput, "forward"},
		{WaitingForInput, Transferring, Transferring, "forward"},
		{Transferring, Success, Success, "forward"},
		{Bootstrapping, Success, Success, "forward, skipping states"},
		{Transferring, WaitingForInput, Transferring, "never backwards"},
		{Success, Bootstrapping, Success, "never backwards"},
		{Success, Transferring, Success, "never backwards"},
		{Transferring, Transferring, Transferring, "same state"},
		{Success, Success, Success, "same state"},
		{Failed, Success, Failed, "Success never overwrites Failed"},
		{Failed, Bootstrapping, Failed, "Failed is sticky"},
		{Failed, Transferring, Failed, "Failed is sticky"},
		{Failed, Failed, Failed, "Failed is sticky"},
		{Bootstrapping, Failed, Failed, "Failed from any state"},
		{WaitingForInput, Failed, Failed, "Failed from any state"},
		{Transferring, Failed, Failed, "Failed from any state"},
		{Success, Failed, Failed, "Failed from any state, even Success"},
		{bad, Success, Failed, "invalid old counts as Failed"},
		{Transferring, bad, Failed, "invalid new counts as Failed"},
	}
	for _, tt := range tests {
		if got := Merge(tt.old, tt.new); got != tt.want {
			t.Errorf("Merge(%v, %v) = %v, want %v (%s)", tt.old, tt.new, got, tt.want, tt.why)
		}
	}
	// Exhaustively: the result is never below old unless it is Failed.
	for old := KVPoll(0); old <= Success; old++ {
		for n := KVPoll(0); n <= Success; n++ {
			got := Merge(old, n)
			if got != Failed && got < old {
				t.Errorf("Merge(%v, %v) = %v moves backwards", old, n, got)
			}
			if old == Failed && got != Failed {
				t.Errorf("Merge(%v, %v) = %v leaves Failed", old, n, got)
			}
		}
	}
}

func TestMinState(t *testing.T) {
	tests := []struct {
		states []KVPoll
		want   KVPoll
	}{
		{nil, Failed},
		{[]KVPoll{Success}, Success},
		{[]KVPoll{Bootstrapping}, Bootstrapping},
		{[]KVPoll{Success, Success, Success}, Success},
		{[]KVPoll{Success, Transferring}, Transferring},
		{[]KVPoll{WaitingForInput, Success, Transferring}, WaitingForInput},
		{[]KVPoll{Success, Failed, Success}, Failed},
		{[]KVPoll{Bootstrapping, Failed}, Failed},
		{[]KVPoll{Success, 7}, Failed},
	}
	for _, tt := range tests {
		if got := MinState(tt.states...); got != tt.want {
			t.Errorf("MinState(%v) = %v, want %v", tt.states, got, tt.want)
		}
	}
}

func TestTerminal(t *testing.T) {
	for s := KVPoll(0); s <= Success; s++ {
		if got, want := s.Terminal(), s == Failed || s == Success; got != want {
			t.Errorf("%v.Terminal() = %v", s, got)
		}
	}
}

func TestParseKVPoll(t *testing.T) {
	for s := Failed; s <= Success; s++ {
		if got, ok := ParseKVPoll(s.String()); !ok || got != s {
			t.Errorf("ParseKVPoll(%q) = %v, %v", s.String(), got, ok)
		}
	}
	for _, name := range []string{"", "failed", "KVPoll(5)", "Done"} {
		if _, ok := ParseKVPoll(name); ok {
			t.Errorf("ParseKVPoll(%q) accepted", name)
		}
	}
}
