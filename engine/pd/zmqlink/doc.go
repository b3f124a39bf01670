// Package zmqlink is pdkit's ZeroMQ transport for prefill/decode
// disaggregation, at the level of frames: it moves multipart messages
// ([][]byte) and knows nothing of their meaning (the message codec lives
// elsewhere and is layered on top).
//
// It talks to libzmq through a small cgo shim (shim.go) rather than
// pebbe/zmq4, the project's named ZeroMQ binding, because pebbe/zmq4 keeps
// its context and socket handles private and copies on both ends (see
// Throughput); pebbe/zmq4 remains the reference the benchmarks compare
// with. ZeroMQ sockets are not safe for concurrent use: a socket must be
// used by one goroutine only, and closing it from another goroutine can
// hang. So every socket here is created, used and closed by exactly one
// owner goroutine, and the exported methods talk to that goroutine
// through channels:
//
//   - An Inbox binds a PULL socket. Its receive goroutine polls the socket
//     with a timeout (so it notices Close) and calls the Handler for each
//     multipart message, on that goroutine, in arrival order. The frames
//     are lent: they are libzmq's receive buffers, valid until the handler
//     returns; a handler copies what it keeps (CloneFrames, bytes.Clone).
//     A handler that returns an error, or panics, has its message counted
//     and dropped; the loop goes on. The loop never exits for a bad
//     message.
//   - An Outbox owns PUSH sockets to any number of peers, all on one sender
//     goroutine. Send enqueues into a bounded queue and returns an error when
//     the queue stays full past its context; the sender connects lazily,
//     never blocks on a slow or dead peer (it sends without waiting and
//     keeps a short per-peer backlog that expires), and Close never hangs
//     because sockets linger only briefly. Frames of 32 KiB or more are
//     handed to libzmq without a copy: they stay pinned (runtime.Pinner)
//     until libzmq's free callback, which runs on a libzmq I/O thread and
//     only queues the message for the sender goroutine to unpin; closing
//     a socket or the Outbox frees (and unpins) whatever libzmq still held.
//
// Each Inbox and Outbox has its own ZeroMQ context (its own I/O thread), so
// Close can terminate it and leave nothing running.
//
// # Throughput
//
// bench_test.go compares Outbox→Inbox (BenchmarkZMQ) with raw Go TCP on
// loopback into a reused buffer (BenchmarkRawTCP) and with the old
// pebbe/zmq4 data path (BenchmarkPebbe) in the same run; `pdserve bench pd`
// does the same with real KV_CHUNK messages. Before the shim, pebbe/zmq4
// copied every frame into a zmq_msg on send and allocated and copied a Go
// slice per frame on receive (which also drove the garbage collector): on
// a busy 2-core machine 1 MiB messages moved at 0.9–1.1 GB/s and 4 MiB at
// 1.4 GB/s, 0.28–0.54 of raw TCP; 4 MiB socket buffers, more frames or
// more sockets did not help. The shim removes both copies: large frames
// are sent with zmq_msg_init_data over the pinned Go memory, and received
// frames are slices over the zmq_msg buffers (libzmq reads a large frame
// straight into its own buffer), lent to the handler.
//
// With the shim, on the same busy 2-core machine (medians of 3
// interleaved runs, ratio to raw TCP in the same run): 1 MiB messages
// 2.7 GB/s (0.90; pebbe/zmq4 1.1 GB/s, 0.39), 4 MiB messages 2.8 GB/s
// (1.07; pebbe/zmq4 1.2 GB/s, 0.48). `pdserve bench pd` on the small model
// (3.4 MiB KV_CHUNK messages, K and V frames of 6 layers): 2.9 GB/s,
// ratio 1.07 (0.50 before). Smaller messages gain less: the tiny model's
// 128 KiB KV_CHUNKs (four 32 KiB payload frames) reach 1.2 GB/s, ratio
// 0.55 (0.33 before), and 128 KiB in four frames in BenchmarkZMQ 1.6 GB/s
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
