package launch

import (
	"bufio"
	"fmt"
	"io"
	"sync"
)

// prefixWriter writes whole lines, each under a name, to one writer; a
// mutex keeps lines of different children from interleaving.
type prefixWriter struct {
	mu    sync.Mutex
	w     io.Writer
	width int // names are padded to it so the lines align
}

func (p *prefixWriter) line(name, text string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, "%-*s | %s\n", p.width, name, text)
}

// pump copies r to the writer line by line under name, keeping the last
// lines in t, until r ends or is closed. A line longer than the reader's
// buffer is written in pieces.
func (p *prefixWriter) pump(name string, r io.Reader, t *tail) {
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		b, _, err := br.ReadLine()
		if len(b) > 0 || err == nil {
			s := string(b)
			t.add(s)
			p.line(name, s)
		}
		if err != nil {
			return
		}
	}
}

// tail keeps the last n lines written.
type tail struct {
	mu   sync.Mutex
	n    int
	buf  []string
	next int // where the next line goes once buf is full
}

func newTail(n int) *tail { return &tail{n: n} }

func (t *tail) add(s string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.buf) < t.n {
		t.buf = append(t.buf, s)
		return
	}
	t.buf[t.next] = s
	t.next = (t.next + 1) % t.n
}

// lines returns the kept lines, oldest first.
func (t *tail) lines() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.buf))
	out = append(out, t.buf[t.next:]...)
	return append(out, t.buf[:t.next]...)
}
