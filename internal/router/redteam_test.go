package router

import (
	"bufio"
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/api/pdproto"
)

// A second client that guesses or enumerates request ids (the router's
// own, the decode side's sequential response ids, the id the stream shows)
// cannot abort another client's stream; the owner, holding the router's
// id, can.
func TestRedTeamCrossClientAbort(t *testing.T) {
	p := newStub(t, pdproto.RolePrefill, blocking)
	d := newStub(t, pdproto.RoleDecode, blocking)
	c := start(t, []*stub{p}, []*stub{d})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// The victim's stream; its first event carries the decode's id cmpl-77.
	resp := c.post(t, ctx, "/v1/completions", `{"prompt":"victim","stream":true}`)
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	p.waitRequests(t, 1)
	owned := resp.Header.Get(RequestIDHeader)
	if !regexp.MustCompile(`^router-[A-Z2-7]{26,}$`).MatchString(owned) {
		t.Fatalf("request id %q: want router- and at least 128 random bits", owned)
	}

	// The attacker's own request shows it the shape of an id.
	mine := c.post(t, ctx, "/v1/completions", `{"prompt":"attacker","stream":true}`)
	defer mine.Body.Close()
	attackerID := mine.Header.Get(RequestIDHeader)
	if attackerID == owned || attackerID[:12] == owned[:12] {
		t.Fatalf("two requests' ids %q and %q share a guessable part", owned, attackerID)
	}

	guesses := []string{"cmpl-77", "77", "chatcmpl-77", "cmpl-1", "0", "", "router-", owned[:len(owned)-1], owned + "A"}
	for n := range 512 {
		guesses = append(guesses, fmt.Sprintf("router-%d", n), fmt.Sprintf("cmpl-%d", n))
	}
	for _, g := range guesses {
		aresp := c.post(t, context.Background(), "/abort_request", fmt.Sprintf(`{"rid":%q}`, g))
		body := readAll(t, aresp)
		if aresp.StatusCode == 200 {
			t.Fatalf("a guessed id %q aborted a request: %s", g, body)
		}
	}
	select {
	case path := <-d.cancels:
		t.Fatalf("a guess cancelled the victim's decode request (%s)", path)
	default:
	}
	if cr := c.clusterState(t); cr.LiveRooms != 2 {
		t.Fatalf("live rooms after the guesses: %d, want the 2 streams", cr.LiveRooms)
	}

	// The owner aborts its own.
	aresp := c.post(t, context.Background(), "/abort_request", fmt.Sprintf(`{"rid":%q}`, owned))
	if body := readAll(t, aresp); aresp.StatusCode != 200 {
		t.Fatalf("the owner's abort: %d %s", aresp.StatusCode, body)
	}
	d.waitCancel(t, "the owner's abort")
	c.waitFor(t, "the victim's room freed", func(cr debug.ClusterResponse) bool { return cr.LiveRooms == 1 })
}
