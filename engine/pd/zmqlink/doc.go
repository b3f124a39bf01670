// Package zmqlink is pdkit's ZeroMQ transport for prefill/decode
// disaggregation, at the level of frames: it moves multipart messages
// ([][]byte) and knows nothing of their meaning (the message codec lives
// elsewhere and is layered on top).
//
// pebbe/zmq4 sockets are not safe for concurrent use: a socket must be used
// by one goroutine only, and closing it from another goroutine can hang. So
// every socket here is created, used and closed by exactly one owner
// goroutine, and the exported methods talk to that goroutine through
// channels:
//
//   - An Inbox binds a PULL socket. Its receive goroutine polls the socket
//     with a timeout (so it notices Close) and calls the Handler for each
//     multipart message, on that goroutine, in arrival order. A handler that
//     returns an error, or panics, has its message counted and dropped; the
//     loop goes on. The loop never exits for a bad message.
//   - An Outbox owns PUSH sockets to any number of peers, all on one sender
//     goroutine. Send enqueues into a bounded queue and returns an error when
//     the queue stays full past its context; the sender connects lazily,
//     never blocks on a slow or dead peer (it sends without waiting and
//     keeps a short per-peer backlog that expires), and Close never hangs
//     because sockets linger only briefly.
//
// Each Inbox and Outbox has its own ZeroMQ context (its own I/O thread), so
// Close can terminate it and leave nothing running.
package zmqlink
