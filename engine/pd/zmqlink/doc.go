// Package zmqlink is pdkit's ZeroMQ transport for prefill/decode
// disaggregation, at the level of frames: it moves multipart messages
// ([][]byte) and knows nothing of their meaning (the message codec lives
// elsewhere and is layered on top).
//
// It has two backends behind one small internal interface (backend.go),
// chosen per Inbox and per Outbox by SocketOptions.ZeroCopy:
//
//   - pebbe/zmq4 (pebbe.go), the project's named ZeroMQ binding and the
//     default: for control traffic (TRANSFER_INFO, ABORT, heartbeat
//     probes), where messages are small and a copy costs nothing.
//   - A small cgo shim over libzmq (shim.go), ZeroCopy: for the KV data
//     path, where pebbe/zmq4's copies on both ends cap throughput at about
//     half of raw TCP (see Throughput). It sends frames of 32 KiB or more
//     without a copy and lends received frames straight from libzmq's
//     buffers.
//
// In engine/serve a decode rank's Inbox (its KV socket) and a prefill
// rank's Outbox (which sends the KV chunks, and the small STATUS,
// ABORT_ACK and heartbeat replies, copied as any frame under 32 KiB is)
// use the shim; a prefill rank's Inbox (its control socket) and a decode
// rank's Outbox use pebbe/zmq4.
// Both backends speak the same ZMTP through the same libzmq, so a PUSH
// socket of one talks to a PULL socket of the other, and both keep one
// contract, so callers never depend on the backend: received frames are
// valid only until the handler returns, and frames given to Send belong
// to the Outbox.
//
// ZeroMQ sockets are not safe for concurrent use: a socket must be
// used by one goroutine only, and closing it from another goroutine can
// hang. So every socket here is created, used and closed by exactly one
// owner goroutine, and the exported methods talk to that goroutine
// through channels:
//
//   - An Inbox binds a PULL socket. Its receive goroutine polls the socket
//     with a timeout (so it notices Close) and calls the Handler for each
//     multipart message, on that goroutine, in arrival order. The frames
//     are lent, valid until the handler returns (with ZeroCopy they are
//     libzmq's receive buffers); a handler copies what it keeps
//     (CloneFrames, bytes.Clone).
//     A handler that returns an error, or panics, has its message counted
//     and dropped; the loop goes on. The loop never exits for a bad
//     message. MaxMsgSize bounds the frames a peer may send: libzmq drops
//     a peer that declares a larger one, counted as a disconnect.
//     MaxConnections bounds the connections the socket holds at once,
//     from the socket monitor's accept and hang-up events, and
//     MaxPending those not yet past their handshake, so that strangers
//     cannot keep members out (conns.go).
//   - An Outbox owns PUSH sockets to its peers, all on one sender
//     goroutine: at most MaxPeers (the least recently used that Send did not
//     feed within PeerIdle is closed for a new one; a stream's socket is
//     never closed for a new peer, since libzmq may still hold its
//     messages) and none unused for PeerIdle, since peers are endpoints
//     that other processes name. Send enqueues into a bounded queue and returns
//     an error when the queue stays full past its context (Offer fails at
//     once instead when the peer's own backlog is full); the sender
//     connects lazily, never blocks on a slow or dead peer (it sends
//     without waiting and keeps a short per-peer backlog that expires), and
//     Close never hangs because sockets linger only briefly. With ZeroCopy, frames of 32 KiB
//     or more are handed to libzmq without a copy: they stay pinned
//     (runtime.Pinner) until libzmq's free callback, which runs on a
//     libzmq I/O thread and only queues the message for the sender
//     goroutine to unpin; closing a socket or the Outbox frees (and
//     unpins) whatever libzmq still held.
//
// Each Inbox and Outbox has its own ZeroMQ context (its own I/O thread), so
// Close can terminate it and leave nothing running.
//
// # Authentication
//
// SocketOptions sets at most one mechanism (auth.go, curve.go); none
// leaves the socket on NULL. An authenticating Inbox's context gets a ZAP
// handler: a REP socket bound to inproc://zeromq.zap.01, on a goroutine of
// its own that starts before the socket binds and stops after it closes,
// before the context terminates. libzmq asks it once per incoming
// connection, during the handshake, so no message of a refused connection
// ever reaches the socket, and an admitted connection pays nothing per
// message for the check. A peer with no credential or another mechanism
// is refused by libzmq before ZAP is asked; the same goroutine reads the
// socket's monitor and counts those too. InboxStats.AuthDenied counts
// every refusal, AuthAdmitted the admitted connections, LastAuthDenied
// says why the last refusal was made (with the peer's address when ZAP had
// it). Both backends do it all, and talk to each other.
//
//   - Auth (a PlainAuth): ZeroMQ's PLAIN with one fixed username and
//     password, compared in constant time.
//   - Rotating (a RotatingAuth): PLAIN with a credential that changes with
//     time, what engine/serve's KV sockets run: an Outbox's socket presents
//     Credential(now) when it is made, and is made anew (OutboxStats.Rotated)
//     once older than Rotate and quiet; an Inbox admits what Admit says.
//     The password crosses the wire in the clear once per connection, so a
//     sniffed one is good only until Admit stops taking it.
//   - Curve (CurveKeys): CurveZMQ, what engine/serve's control sockets
//     run: both ends authenticated by long-term keys, every frame encrypted
//     and authenticated with per-connection transient keys; the ZAP handler
//     admits only the client public key.
//
// bench_test.go measures the cost. BenchmarkAuthCost interleaves bursts of
// 4 MiB messages over a pair without authentication and one with PLAIN,
// so both see the same machine, and reports the ratio plain/none;
// BenchmarkZMQ has 4MiB/plain, 4MiB/rotating and 4MiB/curve beside
// 4MiB/default, 1KiB/curve beside 1KiB/default, and BenchmarkRawTCP in
// the same run. On a busy 2-core machine the ratio plain/none was 1.01
// with the shim (0.96-1.03 over 3 runs of 200 rounds) and 0.92-1.20 with
// pebbe/zmq4: no cost beyond the noise, as nothing is done per message. In
// BenchmarkZMQ (medians of 5 interleaved runs) 4 MiB messages over the shim
// moved at 3.4 GB/s with PLAIN, 3.2 GB/s without and 3.0 GB/s over raw
// TCP; with CURVE at 0.64 GB/s, 0.15 of the same run without
// authentication (0.41 GB/s over pebbe/zmq4). So the KV path keeps PLAIN
// and the control path, whose messages are small, runs CURVE.
//
// # Throughput
//
// bench_test.go compares Outbox→Inbox over each backend
// (BenchmarkZMQ/pebbe/..., BenchmarkZMQ/shim/...) with raw Go TCP on
// loopback into a reused buffer (BenchmarkRawTCP) in the same run;
// `pdserve bench pd` does the same with real KV_CHUNK messages. pebbe/zmq4
// copies every frame into a zmq_msg on send and allocates and copies a Go
// slice per frame on receive (which also drives the garbage collector): on
// a busy 2-core machine 1 MiB messages moved at 0.9–1.1 GB/s and 4 MiB at
// 1.4 GB/s, 0.28–0.54 of raw TCP; 4 MiB socket buffers, more frames or
// more sockets did not help. That is fine for control messages, not for
// KV. The shim removes both copies: large frames
// are sent with zmq_msg_init_data over the pinned Go memory, and received
// frames are slices over the zmq_msg buffers (libzmq reads a large frame
// straight into its own buffer), lent to the handler.
//
// With the shim, on the same busy 2-core machine (medians of 3
// interleaved runs, ratio to raw TCP in the same run): 1 MiB messages
// 2.7 GB/s (0.90; pebbe/zmq4 1.1 GB/s, 0.39), 4 MiB messages 2.8 GB/s
// (1.07; pebbe/zmq4 1.2 GB/s, 0.48). `pdserve bench pd` on the small model
// (3.4 MiB KV_CHUNK messages, K and V frames of 6 layers): 2.9 GB/s,
// ratio 1.07 (0.50 with pebbe/zmq4). Smaller messages gain less: the tiny model's
// 128 KiB KV_CHUNKs (four 32 KiB payload frames) reach 1.2 GB/s, ratio
// 0.55 (0.33 with pebbe/zmq4), and 128 KiB in four frames in BenchmarkZMQ 1.6 GB/s
// (0.56); what is left there is per-message and per-frame work (libzmq's
// I/O threads, the channel hops), not copies, and was not pursued. A
// decode engine's mailbox (engine/serve) copies the KV payload it keeps,
// once, since the frames are only lent.
//
// Explicit 4 MiB SO_SNDBUF/SO_RCVBUF (SocketOptions) were within the noise
// with the shim, so the OS defaults (autotuned) stay. Per-peer HWM 64 is
// the default: 8 was as good for 1 MiB messages but cut 1 KiB message
// throughput by 2.5x.
package zmqlink
