package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pdkit/pdkit/engine/model"
	"github.com/pdkit/pdkit/engine/model/builtin"
	"github.com/pdkit/pdkit/internal/testmodel"
	"github.com/pdkit/pdkit/internal/waitfor"
	"github.com/pdkit/pdkit/kernels"
)

// The listener limits and readiness flags exist on the router and every
// engine role, take their PD_* variables, and refuse what cannot work.
func TestHTTPLimitFlags(t *testing.T) {
	t.Setenv("PD_BODY_TIMEOUT", "7s")
	t.Setenv("PD_MAX_CONNECTIONS", "99")
	for _, cmd := range []string{"router", "serve", "prefill", "decode"} {
		out, stderr, code := run(t, "config", cmd)
		if code != 0 {
			t.Fatalf("config %s: exit %d %s", cmd, code, stderr)
		}
		for _, want := range []string{"PD_HEADER_TIMEOUT", "PD_BODY_TIMEOUT", "7s", "PD_MAX_CONNECTIONS", "99", "PD_READY_FAILURE_RATE", "PD_READY_WINDOW"} {
			if !strings.Contains(out, want) {
				t.Errorf("config %s: no %s in %q", cmd, want, out)
			}
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--body-timeout", "0s"}, "--body-timeout"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--max-connections", "0"}, "--max-connections"},
		{[]string{"router", "--prefill", "http://a:1", "--decode", "http://b:1", "--ready-failure-rate", "1.5"}, "--ready-failure-rate"},
	} {
		_, stderr, code := run(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}

// A real pdserve serve enforces its flags' limits on its listener, counts
// the hits on its /metrics, and answers /livez and /readyz.
func TestServeListenerLimits(t *testing.T) {
	path := testmodel.Path(t, builtin.Spec{Arch: model.ArchLlamaDSA, Size: builtin.SizeTiny, Seed: 11, Type: kernels.F32})
	s := startServe(t, "--model", path, "--threads", "1", "--shutdown-timeout", "1ms",
		"--body-timeout", "200ms", "--max-connections", "2")
	addr := strings.TrimPrefix(s.url, "http://")
	once := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	for _, p := range []string{"/livez", "/readyz"} {
		resp, err := once.Get(s.url + p)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"status":"ok"`) {
			t.Errorf("%s: %d %s", p, resp.StatusCode, b)
		}
	}

	// A body that never comes: 408 at the body timeout.
	slow, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	fmt.Fprintf(slow, "POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Length: 100\r\n\r\n{")
	slow.SetReadDeadline(time.Now().Add(10 * time.Second))
	if line, err := bufio.NewReader(slow).ReadString('\n'); err != nil || !strings.Contains(line, " 408 ") {
		t.Fatalf("a body that never comes: %q %v", line, err)
	}
	slow.Close()

	// Two connections in the middle of their headers fill the cap (once
	// the server has closed the ones before: a refused one hears 503 at
	// once); a third, a whole request, takes the place of the one that
	// has waited longest without sending its headers, which is closed.
	// (TestRedTeamSilentConnectionsYieldToRequests has the rest.)
	var held []net.Conn
	for range 2 {
		waitfor.NoError(t, "a connection under the cap taken", 10*time.Second, func() error {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(c, "GET /livez HTTP/1.1\r\nHost: s\r\n") // the headers' end never comes
			c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			line, err := bufio.NewReader(c).ReadString('\n')
			if errors.Is(err, os.ErrDeadlineExceeded) { // taken, reading the headers
				held = append(held, c)
				return nil
			}
			c.Close()
			return fmt.Errorf("%q %v", line, err)
		})
	}
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "GET /livez HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, _ := io.ReadAll(c)
	c.Close()
	if !strings.HasPrefix(string(got), "HTTP/1.1 200 ") {
		t.Fatalf("a whole request past the cap: %q", got)
	}
	held[0].SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := held[0].Read(make([]byte, 1)); n != 0 || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the connection silent the longest was not closed: %d %v", n, err)
	}

	// Both hits are on /metrics once a place is free.
	for _, c := range held {
		c.Close()
	}
	waitfor.NoError(t, "both hits on /metrics", 10*time.Second, func() error {
		resp, err := once.Get(s.url + "/metrics")
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(b), `pdkit_http_limit_hits_total{limit="body_timeout"} 1`) ||
			!regexp.MustCompile(`pdkit_http_limit_hits_total\{limit="connections(_per_address)?"\} [1-9]`).Match(b) {
			return fmt.Errorf("metrics without the hits: %s", b)
		}
		return nil
	})
}
