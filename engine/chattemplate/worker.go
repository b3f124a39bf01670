package chattemplate

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"time"
)

// A worker is the running binary started with workerEnv set: this
// package's init sees it and serves renders on stdin and stdout until
// stdin ends, never returning to the program's main. The parent writes
// one frame (a 4-byte length, then JSON) and reads one back.

// workerEnv carries a worker's Bounds; set, the process is a worker.
const workerEnv = "PDKIT_CHAT_TEMPLATE_WORKER"

func init() {
	if b, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(serveWorker(b, os.Stdin, os.Stdout))
	}
}

type workRequest struct {
	Source      string        `json:"source,omitempty"` // empty when Known
	Known       bool          `json:"known,omitempty"`  // the source the worker compiled last
	BOS         string        `json:"bos"`
	EOS         string        `json:"eos"`
	Now         int64         `json:"now"` // strftime_now's time, unix nanoseconds
	Messages    []workMessage `json:"messages"`
	Generation  bool          `json:"generation"`
	MaxOutput   int           `json:"max_output"`
	CompileOnly bool          `json:"compile_only,omitempty"`
}

type workMessage struct {
	Role       string `json:"role"`
	Content    string `json:"content"`
	Name       string `json:"name,omitempty"`
	ToolCallID string `json:"tool_call_id,omitempty"`
}

type workResponse struct {
	Out      string  `json:"out,omitempty"`
	Raise    *string `json:"raise,omitempty"` // the template's raise_exception
	Err      string  `json:"err,omitempty"`
	Bound    string  `json:"bound,omitempty"` // BoundOutput: refused
	Compiled bool    `json:"compiled"`        // the worker holds the source compiled
}

// maxRequestBytes bounds what a worker reads in one frame: a request
// holds a conversation that the server already bounded by its context.
const maxRequestBytes = 1 << 30

// maxResponseBytes bounds what the server reads back: the output bound,
// escaped, and the rest.
func maxResponseBytes(maxOutput int) int { return 6*maxOutput + 1<<20 }

func writeFrame(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(b)))
	if _, err := w.Write(n[:]); err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

func readFrame(r io.Reader, v any, limit int) error {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return err
	}
	size := int(binary.BigEndian.Uint32(n[:]))
	if size > limit {
		return fmt.Errorf("a frame of %d bytes, over %d", size, limit)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(r, b); err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// encode writes b for workerEnv: time, memory, stack.
func (b Bounds) encode() string {
	return fmt.Sprintf("%d,%d,%d", b.Time, b.Memory, b.Stack)
}

func decodeBounds(s string) (Bounds, error) {
	f := strings.Split(s, ",")
	if len(f) != 3 {
		return Bounds{}, fmt.Errorf("%s=%q: want time,memory,stack", workerEnv, s)
	}
	var n [3]int64
	for i := range f {
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil || v <= 0 {
			return Bounds{}, fmt.Errorf("%s=%q: want three positive numbers", workerEnv, s)
		}
		n[i] = v
	}
	return Bounds{Time: time.Duration(n[0]), Memory: n[1], Stack: int(n[2])}, nil
}

// serveWorker is a worker's life: bound itself, then render each request
// until stdin ends. It returns the exit code.
func serveWorker(env string, in io.Reader, out io.Writer) int {
	b, err := decodeBounds(env)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chat template worker:", err)
		return 2
	}
	if err := limitMemory(b.Memory); err != nil {
		fmt.Fprintln(os.Stderr, "chat template worker: memory bound:", err)
		return 2
	}
	debug.SetMaxStack(b.Stack)
	// The collector works harder as the heap nears the bound, so that
	// garbage a loop leaves does not pass it; only what a render holds does.
	debug.SetMemoryLimit(b.Memory / 2)
	r, w := bufio.NewReader(in), bufio.NewWriter(out)
	var (
		tmpl *Template // the last source's, kept for the next request that is Known
		now  time.Time
	)
	for {
		var req workRequest
		if err := readFrame(r, &req, maxRequestBytes); err != nil {
			if err == io.EOF {
				return 0
			}
			fmt.Fprintln(os.Stderr, "chat template worker:", err)
			return 2
		}
		// Should the server be gone, a render that runs on ends here.
		watchdog := time.AfterFunc(2*b.Time+time.Second, func() { os.Exit(3) })
		var resp workResponse
		if !req.Known {
			tmpl = nil
			t, err := Compile(req.Source, Options{BOS: req.BOS, EOS: req.EOS, Now: func() time.Time { return now }})
			if err != nil {
				resp.Err = err.Error()
			} else {
				tmpl = t
			}
		}
		if tmpl != nil {
			resp.Compiled = true
			tmpl.opts.BOS, tmpl.opts.EOS = req.BOS, req.EOS
		}
		if tmpl != nil && !req.CompileOnly {
			now = time.Unix(0, req.Now)
			msgs := make([]Message, len(req.Messages))
			for i, m := range req.Messages {
				msgs[i] = Message(m)
			}
			s, err := tmpl.Render(msgs, req.Generation)
			switch re := err.(type) {
			case nil:
				if len(s) > req.MaxOutput {
					resp.Bound = BoundOutput
				} else {
					resp.Out = s
				}
			case *RaiseError:
				resp.Raise = &re.Message
			default:
				resp.Err = err.Error()
			}
		}
		watchdog.Stop()
		if err := writeFrame(w, &resp); err != nil || w.Flush() != nil {
			return 0 // the server is gone
		}
	}
}
