package httpx

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The descriptor-limit tests run the server in a child process (this test
// binary again, with fdChildEnv set) whose open-file limit is lowered to
// fdChildLimit: lowering the test process's own would starve every other
// test.
const (
	fdChildEnv   = "PDKIT_HTTPX_FD_CHILD"
	fdChildLimit = 128
)

// A flood of silent connections larger than the process's descriptor
// limit does not keep the liveness probe out: with --max-connections far
// above the limit, the guard lowers the cap to fit (ConnsWithin) and sheds
// the oldest silent connection at the cap; with the descriptors spent
// elsewhere, so that accepting fails (EMFILE) before the cap, it closes a
// silent connection to free one. Each is counted.
func TestProbesPastTheDescriptorLimit(t *testing.T) {
	if mode := os.Getenv(fdChildEnv); mode != "" {
		fdChild(mode)
		return
	}
	for _, tc := range []struct {
		mode    string
		counter string // the limit hit that let the probe in
	}{
		{"cap", LimitPerAddress}, // one source: its own cap, under the listener's
		{"exhausted", LimitDescriptors},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestProbesPastTheDescriptorLimit$")
			cmd.Env = append(os.Environ(), fdChildEnv+"="+tc.mode)
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				stdin.Close() // the child exits on its stdin's end
				if err := cmd.Wait(); err != nil {
					t.Errorf("the child: %v", err)
				}
			})
			line, err := bufio.NewReader(stdout).ReadString('\n')
			if err != nil {
				t.Fatalf("the child's address: %v", err)
			}
			var addr string
			var maxConns int
			if _, err := fmt.Sscanf(line, "%s %d", &addr, &maxConns); err != nil {
				t.Fatalf("the child said %q: %v", line, err)
			}
			if want := ConnsWithin(fdChildLimit); maxConns != want {
				t.Errorf("--max-connections 4096 under an open-file limit of %d: cap %d, want %d", fdChildLimit, maxConns, want)
			}
			// Twice the descriptor limit of connections that send nothing.
			for range 2 * fdChildLimit {
				c, err := net.Dial("tcp", addr)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
			}
			hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
			for i := range 3 {
				resp, err := hc.Get("http://" + addr + "/livez")
				if err != nil {
					t.Fatalf("probe %d in the flood: %v", i, err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || string(body) != "ok" {
					t.Fatalf("probe %d in the flood: %d %q", i, resp.StatusCode, body)
				}
			}
			resp, err := hc.Get("http://" + addr + "/hits")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			t.Logf("%s: limit hits %s", tc.mode, body)
			if !strings.Contains(string(body), tc.counter+"=") || strings.Contains(string(body), tc.counter+"=0 ") {
				t.Errorf("the flood hit no %s limit: %s", tc.counter, body)
			}
		})
	}
}

// fdChild serves /livez and /hits under a guard with --max-connections
// 4096 and an open-file limit of fdChildLimit, prints its address and cap,
// and exits when its stdin ends. In mode "exhausted" it first opens files
// until a few descriptors are left, below the cap.
func fdChild(mode string) {
	lim := syscall.Rlimit{Cur: fdChildLimit, Max: fdChildLimit}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, "setrlimit:", err)
		os.Exit(2)
	}
	g := NewGuard(Limits{HeaderTimeout: time.Minute, BodyTimeout: time.Minute, MaxConns: 4096})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(2)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })
	mux.HandleFunc("/hits", func(w http.ResponseWriter, _ *http.Request) {
		for _, n := range limitNames {
			fmt.Fprintf(w, "%s=%d ", n, g.Hits(n))
		}
	})
	srv := g.Server(mux, nil)
	srv.ErrorLog = nil
	gl := g.Listener(ln)
	if mode == "exhausted" {
		// Leave 16 descriptors: accepting fails long before the cap.
		var held []*os.File
		for {
			f, err := os.Open(os.DevNull)
			if err != nil {
				break
			}
			held = append(held, f)
		}
		for _, f := range held[len(held)-16:] {
			f.Close()
		}
		defer func() {
			for _, f := range held {
				f.Close()
			}
		}()
	}
	go srv.Serve(gl)
	fmt.Printf("%s %d\n", ln.Addr(), g.Limits().MaxConns)
	io.Copy(io.Discard, os.Stdin)
	srv.Close()
	os.Exit(0)
}
