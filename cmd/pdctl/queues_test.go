package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdkit/pdkit/api/client"
	"github.com/pdkit/pdkit/api/debug"
	"github.com/pdkit/pdkit/engine/serve"
	"github.com/pdkit/pdkit/internal/waitfor"
)

// oneSided leaves c with two rooms stuck on one side each: room 7 sent to
// the prefill only (it waits in its bootstrap queue for the decode's
// transfer info) and room 9 sent to the decode only (it waits in its
// transfer queue for KV that no prefill will send): the second is what
// "decode waits for KV that prefill forgot" looks like.
func (c *cluster) oneSided(t *testing.T) {
	t.Helper()
	body := map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": true}
	p := map[string]any{"bootstrap_room": 7}
	d := map[string]any{"bootstrap_room": 9, "bootstrap_url": c.registry}
	for k, v := range body {
		p[k], d[k] = v, v
	}
	send(t, c.prefill.ts.URL, p)
	send(t, c.decode.ts.URL, d)
	waitfor.For(t, "room 7 in the prefill's bootstrap queue, room 9 in the decode's transfer queue", 10*time.Second, func() bool {
		return pdCounts(t, c.prefill, debug.PDQueueBootstrap) == 2 && pdCounts(t, c.decode, debug.PDQueueTransfer) == 2
	})
}

func TestQueuesDump(t *testing.T) {
	c := newCluster(t)
	c.oneSided(t)
	tests := []struct {
		name   string
		args   []string
		code   exitCode
		stdout string
		stderr string
	}{
		{
			name: "every queue",
			args: []string{"queues", "dump"},
			stdout: "PREFILL\tprefill\t0\t1\t7\tbootstrap\tBootstrapping\tBootstrapping\t*\t-\t0\tno\t-\n" +
				"PREFILL\tprefill\t1\t1\t7\tbootstrap\tBootstrapping\tBootstrapping\t*\t-\t0\tno\t-\n" +
				"DECODE\tdecode\t0\t1\t9\ttransfer\tWaitingForInput\tWaitingForInput\t*\tPREFILL-RANK0\t0\tno\t-\n" +
				"DECODE\tdecode\t1\t1\t9\ttransfer\tWaitingForInput\tWaitingForInput\t*\tPREFILL-RANK1\t0\tno\t-\n" +
				"\n" +
				"7\tPREFILL\t0,1\tbootstrap\tBootstrapping\t*\t-\t-\t-\t-\t-\n" +
				"9\t-\t-\t-\t-\t-\tDECODE\t0,1\ttransfer\tWaitingForInput\t*\n",
		},
		{
			name: "one rank, one queue",
			args: []string{"queues", "dump", "--rank", "1", "--queue", "transfer"},
			stdout: "DECODE\tdecode\t1\t1\t9\ttransfer\tWaitingForInput\tWaitingForInput\t*\tPREFILL-RANK1\t0\tno\t-\n" +
				"\n" +
				"9\t-\t-\t-\t-\t-\tDECODE\t1\ttransfer\tWaitingForInput\t*\n",
		},
		{
			name: "one server, with an unreachable one",
			args: []string{"--server", c.prefill.ts.URL, "--server", "http://127.0.0.1:1", "queues", "dump"},
			code: exitFindings,
			stdout: "PREFILL\tprefill\t0\t1\t7\tbootstrap\tBootstrapping\tBootstrapping\t*\t-\t0\tno\t-\n" +
				"PREFILL\tprefill\t1\t1\t7\tbootstrap\tBootstrapping\tBootstrapping\t*\t-\t0\tno\t-\n" +
				"http://127.0.0.1:1\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\tunreachable: GET http://127.0.0.1:1/pd/v1/info: dial tcp 127.0.0.1:1: connect: connection refused\n" +
				"\n" +
				"7\tPREFILL\t0,1\tbootstrap\tBootstrapping\t*\t-\t-\t-\t-\t-\n",
			stderr: "pdctl: 1 server of 2 unreachable\n",
		},
		{
			name: "json",
			args: []string{"queues", "dump", "--json", "--rank", "0"},
			stdout: `{
  "entries": [
    {
      "server": "PREFILL",
      "role": "prefill",
      "rank": 0,
      "id": "1",
      "room": "7",
      "queue": "bootstrap",
      "in_queue_ms": 0,
      "tokens": 9,
      "chunks": 0,
      "bytes": 0,
      "abort_sent": false,
      "abort_acked": false,
      "poll": "Bootstrapping",
      "agreed": "Bootstrapping",
      "deadline_in_ms": 0,
      "leased": true
    },
    {
      "server": "DECODE",
      "role": "decode",
      "rank": 0,
      "id": "1",
      "room": "9",
      "queue": "transfer",
      "in_queue_ms": 0,
      "peer": "PREFILL-RANK0",
      "tokens": 9,
      "chunks": 0,
      "bytes": 0,
      "abort_sent": false,
      "abort_acked": false,
      "poll": "WaitingForInput",
      "agreed": "WaitingForInput",
      "deadline_in_ms": 0
    }
  ],
  "rooms": [
    {
      "room": "7",
      "prefill": [
        {
          "server": "PREFILL",
          "ranks": [
            0
          ],
          "queue": "bootstrap",
          "agreed": "Bootstrapping",
          "in_queue_ms": 0
        }
      ],
      "decode": []
    },
    {
      "room": "9",
      "prefill": [],
      "decode": [
        {
          "server": "DECODE",
          "ranks": [
            0
          ],
          "queue": "transfer",
          "agreed": "WaitingForInput",
          "in_queue_ms": 0
        }
      ]
    }
  ]
}
`,
		},
		{
			name:   "unknown queue",
			args:   []string{"queues", "dump", "--queue", "waiting"},
			code:   exitUsage,
			stderr: "pdctl: unknown queue \"waiting\" (known: bootstrap, active, inflight, prealloc, transfer, aborting)\nRun 'pdctl queues dump --help' for usage.\n",
		},
		{
			name:   "watch is human only",
			args:   []string{"queues", "dump", "--watch", "--json"},
			code:   exitUsage,
			stderr: "pdctl: --watch and --json cannot be used together\nRun 'pdctl queues dump --help' for usage.\n",
		},
		{
			name:   "no verb",
			args:   []string{"queues"},
			code:   exitUsage,
			stderr: "pdctl: queues needs a command: dump\nRun 'pdctl queues --help' for usage.\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := c.pdctl(t, false, tt.args...)
			stdout = maskJSON(stdout, "in_queue_ms", "deadline_in_ms")
			if code != tt.code {
				t.Errorf("exit code = %d, want %d", code, tt.code)
			}
			if stdout != tt.stdout {
				t.Errorf("stdout:\n%s\nwant:\n%s", stdout, tt.stdout)
			}
			if stderr != tt.stderr {
				t.Errorf("stderr:\n%s\nwant:\n%s", stderr, tt.stderr)
			}
		})
	}
}

// frames is a writer that cancels a watch once it has seen n frames.
type frames struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	n      int
	cancel context.CancelFunc
}

func (w *frames) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if strings.Count(w.buf.String(), "\x1b[H\x1b[2J") > w.n {
		w.cancel()
	}
	return len(p), nil
}

// TestQueuesWatch redraws until the context ends, then exits 0.
func TestQueuesWatch(t *testing.T) {
	c := newCluster(t)
	c.oneSided(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	w := &frames{n: 2, cancel: cancel}
	f := &factory{Out: w, ErrOut: &bytes.Buffer{}, OutTTY: true, maskVolatile: true}
	f.attach.Router = c.router
	var opts *queuesDumpOptions
	cmd := newCmdQueuesDump(f, func(_ context.Context, o *queuesDumpOptions) error { opts = o; return nil })
	cmd.SetArgs([]string{"--watch", "--queue", "transfer"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if !opts.Watch || opts.Queue != "transfer" || opts.Rank != -1 || opts.Interval != time.Second {
		t.Fatalf("options %+v", *opts)
	}
	opts.Interval = 10 * time.Millisecond
	if err := queuesDumpRun(ctx, opts); err != nil {
		t.Fatal(err)
	}
	// The names of the servers are shorter than their URLs: the columns
	// are compared with their padding folded to two spaces.
	got := regexp.MustCompile(` {2,}`).ReplaceAllString(c.names(w.buf.String()), "  ")
	frame := "\x1b[H\x1b[2J" +
		"SERVER  ROLE  RANK  ID  ROOM  QUEUE  POLL  AGREED  AGE  PEER  BYTES  ABORT  ERROR\n" +
		"DECODE  decode  0  1  9  transfer  WaitingForInput  WaitingForInput  *  PREFILL-RANK0  0  no  -\n" +
		"DECODE  decode  1  1  9  transfer  WaitingForInput  WaitingForInput  *  PREFILL-RANK1  0  no  -\n" +
		"\n" +
		"ROOM  PREFILL SERVER  P RANKS  P QUEUE  P POLL  P AGE  DECODE SERVER  D RANKS  D QUEUE  D POLL  D AGE\n" +
		"9  -  -  -  -  -  DECODE  0,1  transfer  WaitingForInput  *\n"
	if want := strings.Repeat(frame, 3); got != want {
		t.Errorf("got:\n%q\nwant:\n%q", got, want)
	}
}

// newWedged returns a cluster wedged as bootstrap-abort-crash wedges one,
// with PD timeouts (heartbeat and abort-ack included) long enough that
// nothing moves while the tests read it: the fault is on at the prefill;
// room 9, sent to the decode alone, was aborted there, so each decode rank
// sent ABORT to its prefill peer, which killed every prefill control loop,
// and the room waits in the decode's aborting queue for acks that will not
// come; room 10, sent to the decode alone afterwards, waits in its transfer
// queue for KV.
func newWedged(t *testing.T) *cluster {
	t.Helper()
	saved := testConfig
	testConfig.PD = serve.PDConfig{BootstrapTimeout: time.Minute, TransferTimeout: time.Minute, AbortAckTimeout: time.Minute,
		HeartbeatTimeout: time.Minute}
	c := newCluster(t)
	testConfig = saved
	ctx := t.Context()
	if _, err := client.New(c.prefill.ts.URL, "", nil).SetFault(ctx, "bootstrap-abort-crash", true); err != nil {
		t.Fatal(err)
	}
	decodeOnly := func(room int) {
		send(t, c.decode.ts.URL, map[string]any{"prompt": "once upon a time", "max_tokens": 4, "temperature": 0,
			"ignore_eos": true, "bootstrap_room": room, "bootstrap_url": c.registry})
	}
	decodeOnly(9)
	waitfor.For(t, "room 9 in the decode's transfer queue", 10*time.Second, func() bool {
		return pdCounts(t, c.decode, debug.PDQueueTransfer) == 2
	})
	if _, err := client.New(c.decode.ts.URL, "", nil).AbortRoom(ctx, 9); err != nil {
		t.Fatal(err)
	}
	waitfor.For(t, "every prefill control loop dead", 10*time.Second, func() bool {
		return len(deadRanks(t, c)) == c.prefill.eng.View().Ranks()
	})
	decodeOnly(10)
	waitfor.For(t, "room 10 in the decode's transfer queue", 10*time.Second, func() bool {
		return pdCounts(t, c.decode, debug.PDQueueTransfer) == 2 && pdCounts(t, c.decode, debug.PDQueueAborting) == 2
	})
	return c
}

// TestQueuesDumpWedged: an aborted decode room shows its ABORT sent and
// never acknowledged, its transfer Failed, beside a room waiting for KV:
// the wedge as an operator sees it.
func TestQueuesDumpWedged(t *testing.T) {
	c := newWedged(t)
	code, stdout, stderr := c.pdctl(t, false, "queues", "dump")
	want := "DECODE\tdecode\t0\t1\t9\taborting\tFailed\tFailed\t*\tPREFILL-RANK0\t0\tsent\taborted by an operator\n" +
		"DECODE\tdecode\t0\t2\t10\ttransfer\tWaitingForInput\tWaitingForInput\t*\tPREFILL-RANK0\t0\tno\t-\n" +
		"DECODE\tdecode\t1\t1\t9\taborting\tFailed\tFailed\t*\tPREFILL-RANK1\t0\tsent\taborted by an operator\n" +
		"DECODE\tdecode\t1\t2\t10\ttransfer\tWaitingForInput\tWaitingForInput\t*\tPREFILL-RANK1\t0\tno\t-\n" +
		"\n" +
		"9\t-\t-\t-\t-\t-\tDECODE\t0,1\taborting\tFailed\t*\n" +
		"10\t-\t-\t-\t-\t-\tDECODE\t0,1\ttransfer\tWaitingForInput\t*\n"
	if code != exitOK || stdout != want || stderr != "" {
		t.Errorf("exit %d\nstdout:\n%s\nwant:\n%s\nstderr:\n%s", code, stdout, want, stderr)
	}
}
