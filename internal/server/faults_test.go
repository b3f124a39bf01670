package server

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// Fault switches are listed by the debug API and switched live by the
// admin API, only on servers of their role.
func TestFaultSwitches(t *testing.T) {
	m := testmodel.Open(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	e := newEnvModel(t, m, serve.Config{PageSize: 4, MaxRunning: 4, Role: pdproto.RolePrefill})
	e.srv.opts.Loopback = true
	faults := func() map[string]bool {
		resp, err := http.Get(e.ts.URL + "/debug/v1/faults")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var fr debug.FaultsResponse
		if err := json.NewDecoder(resp.Body).Decode(&fr); err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, f := range fr.Faults {
			out[f.Name] = f.On
		}
		return out
	}
	if on, ok := faults()[serve.FaultBootstrapAbortCrash]; !ok || on {
		t.Fatalf("faults at start: %v", faults())
	}
	for _, c := range []struct {
		path   string
		status int
		on     bool
	}{
		{"/admin/v1/faults/bootstrap-abort-crash/on", 200, true},
		{"/admin/v1/faults/bootstrap-abort-crash/off", 200, false},
		{"/admin/v1/faults/no-such-fault/on", 400, false},
	} {
		resp, err := http.Post(e.ts.URL+c.path, "application/json", nil)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || faults()[serve.FaultBootstrapAbortCrash] != c.on {
			t.Errorf("%s: %d %s; faults %v", c.path, resp.StatusCode, body, faults())
		}
	}
	// A colocated server has no bootstrap loop to break.
	col := newEnvModel(t, m, serve.Config{PageSize: 4, MaxRunning: 4})
	col.srv.opts.Loopback = true
	resp, err := http.Post(col.ts.URL+"/admin/v1/faults/bootstrap-abort-crash/on", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(body), "applies to") {
		t.Errorf("colocated: %d %s", resp.StatusCode, body)
	}
}

// An operator aborts a PD request by its bootstrap room, in whatever queue
// it waits: here a decode request whose prefill half never came.
func TestAdminAbortRoom(t *testing.T) {
	_, de, registry := newPDServers(t, serve.Config{PageSize: 4, MaxRunning: 4})
	de.srv.opts.Loopback = true
	const room = 515
	res := make(chan string, 1)
	go func() {
		out, err := de.completeErr("/v1/completions", map[string]any{"prompt": "alone", "max_tokens": 4, "bootstrap_room": room, "bootstrap_url": registry})
		if err != nil {
			res <- err.Error()
			return
		}
		res <- out.Finish
	}()
	waitfor.For(t, "the room known", 20*time.Second, func() bool { _, ok := de.eng.PD().RoomRequest(room); return ok })
	for _, c := range []struct {
		path   string
		status int
	}{{"/admin/v1/rooms/x/abort", 400}, {"/admin/v1/rooms/516/abort", 404}, {"/admin/v1/rooms/515/abort", 200}} {
		resp, err := http.Post(de.ts.URL+c.path, "application/json", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("%s: %d, want %d", c.path, resp.StatusCode, c.status)
		}
	}
	select {
	case got := <-res:
		if got != "abort" {
			t.Errorf("the aborted request ended with %q", got)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the aborted request did not end")
	}
	// The loop forgets the room after it ends the request's stream.
	waitfor.For(t, "the room forgotten after its request", 10*time.Second, func() bool {
		_, ok := de.eng.PD().RoomRequest(room)
		return !ok
	})
}
