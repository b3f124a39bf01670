package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"syscall"
	"time"
)

// portTaken is the error of a listener whose port another process holds:
// which port, which flag sets it, and how to choose another, without a
// retry (the same port would be taken again).
type portTaken struct {
	port int
	flag string // the flag that sets it, e.g. --port
	err  error
	make bool // set through make run's ARGS too (launch's --port)
}

func (e *portTaken) Error() string {
	return fmt.Sprintf("port %d is taken by another process (%v): %s", e.port, e.err, portHint(e.flag, e.make))
}

// portHint says how to choose another port than a taken one.
func portHint(flag string, viaMake bool) string {
	h := fmt.Sprintf("choose another with %s N (0 picks a free one)", flag)
	if viaMake {
		h += fmt.Sprintf(`, e.g. make run ARGS="%s 8001"`, flag)
	}
	return h
}

func (e *portTaken) Unwrap() error { return e.err }

// listen listens on host:port, set by flag; a port that is taken is a
// *portTaken error.
func listen(host string, port int, flag string) (net.Listener, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, &portTaken{port: port, flag: flag, err: err}
	}
	return ln, err
}

// checkPort refuses a port no listener can take, named by flag, the flag
// that sets it. It is the commands' one check of their ports, made before
// they build anything (listen would refuse it only after).
func checkPort(flag string, port int) error {
	if port < 0 || port > 65535 {
		return usagef("%s %d: want 0 to 65535", flag, port)
	}
	return nil
}

// checkShutdown refuses a --shutdown-timeout serveUntilDone cannot wait
// for: the servers' one check of it.
func checkShutdown(timeout time.Duration) error {
	if timeout <= 0 {
		return usagef("--shutdown-timeout %v must be positive", timeout)
	}
	return nil
}

// cutGrace is how long the requests cut at a shutdown's deadline have to
// tell their clients so before their connections are closed.
const cutGrace = 2 * time.Second

// serveUntilDone serves ln until ctx ends, then shuts srv down: no new
// connection is accepted, and requests in flight, streams included, may
// finish for up to timeout. At that deadline cut (when not nil) ends the
// requests still running, each telling its client it was cut (an SSE error
// event on a stream), and after up to cutGrace for them to do so the
// connections left are closed. It returns the server's failure, if it
// failed before ctx ended.
func serveUntilDone(ctx context.Context, srv *http.Server, ln net.Listener, log *slog.Logger, timeout time.Duration, cut func()) error {
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down", "timeout", timeout)
	sctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		if cut != nil {
			log.Warn("requests still in flight at the shutdown deadline; cutting them", "timeout", timeout)
			cut()
			cctx, ccancel := context.WithTimeout(context.Background(), cutGrace)
			err = srv.Shutdown(cctx) // waits for the cut handlers to end their answers
			ccancel()
		}
		if err != nil {
			log.Warn("requests still in flight; closing their connections", "err", err)
			srv.Close()
		}
	}
	if err := <-done; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
