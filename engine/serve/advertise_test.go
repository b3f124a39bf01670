package serve

import "testing"

func TestAdvertisedEndpointNamesTheAdvertiseHost(t *testing.T) {
	for _, c := range []struct{ bound, host, want string }{
		{"tcp://0.0.0.0:41234", "10.231.0.2", "tcp://10.231.0.2:41234"},
		{"tcp://127.0.0.1:5555", "127.0.0.1", "tcp://127.0.0.1:5555"},
		{"tcp://0.0.0.0:7", "prefill-0.pd.svc", "tcp://prefill-0.pd.svc:7"},
		{"tcp://[::]:7", "fd00::2", "tcp://[fd00::2]:7"},
	} {
		got, err := advertisedEndpoint(c.bound, c.host)
		if err != nil || got != c.want {
			t.Errorf("advertisedEndpoint(%q, %q) = %q, %v; want %q", c.bound, c.host, got, err, c.want)
		}
	}
}

func TestAdvertisedEndpointRefusesAWildcard(t *testing.T) {
	for _, host := range []string{"0.0.0.0", "::", "[::]", "", "*"} {
		if got, err := advertisedEndpoint("tcp://0.0.0.0:41234", host); err == nil {
			t.Errorf("advertisedEndpoint with host %q = %q; want an error", host, got)
		}
	}
	if err := (PDConfig{Host: "0.0.0.0", HeartbeatInterval: 1, HeartbeatTimeout: 2}).validate(); err == nil {
		t.Error("validate accepted PD host 0.0.0.0 without an advertise host")
	}
	if err := (PDConfig{Host: "0.0.0.0", AdvertiseHost: "10.231.0.2", HeartbeatInterval: 1, HeartbeatTimeout: 2}).validate(); err != nil {
		t.Errorf("validate with an advertise host: %v", err)
	}
}
