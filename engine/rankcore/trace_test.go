package rankcore

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/dist"
	"github.com/pdkit/pdkit/internal/tracetest"
)

// TestTraces runs testdata/order-*.txt: the tables printed, cursors walked
// through them and recorded logs checked against them. Commands:
//
//	print TABLE|phases              the table as String prints it, or PhaseList
//	walk TABLE PHASE...             a cursor enters each phase: its row, or why it refused
//	log [from=SEQ] PHASE[/OP]...    the next rank's control log, seqs from SEQ (1); OP overrides the phase's
//	check TABLE                     CheckLog over the ranks logged since the last check
func TestTraces(t *testing.T) {
	tracetest.Run(t, "testdata/order-*.txt", func(t *testing.T) func(string) string {
		var logs [][]Entry
		return func(line string) string {
			f := strings.Fields(line)
			switch f[0] {
			case "print":
				if f[1] == "phases" {
					return PhaseList()
				}
				tb, err := table(f[1])
				if err != nil {
					return err.Error() + "\n"
				}
				return tb.String()
			case "walk":
				tb, err := table(f[1])
				if err != nil {
					return err.Error() + "\n"
				}
				c := NewCursor(tb)
				var b strings.Builder
				for _, name := range f[2:] {
					p, err := ParsePhase(name)
					if err == nil {
						err = c.Enter(p)
					}
					if err != nil {
						fmt.Fprintf(&b, "%s: refused: %v\n", name, err)
						continue
					}
					if p.Comm() == Fwd {
						fmt.Fprintf(&b, "%s: on the forward communicator\n", name)
						continue
					}
					r, _ := c.At()
					fmt.Fprintf(&b, "%s: row %d (of %s)\n", name, c.at+1, r.Of)
				}
				return b.String()
			case "log":
				log, err := parseLog(f[1:])
				if err != nil {
					return err.Error() + "\n"
				}
				logs = append(logs, log)
				if len(log) == 0 {
					return fmt.Sprintf("rank %d: no calls\n", len(logs)-1)
				}
				return fmt.Sprintf("rank %d: seqs %d..%d\n", len(logs)-1, log[0].Seq, log[len(log)-1].Seq)
			case "check":
				tb, err := table(f[1])
				if err != nil {
					return err.Error() + "\n"
				}
				err = CheckLog(tb, logs)
				logs = nil
				if err != nil {
					return err.Error() + "\n"
				}
				return "ok\n"
			}
			return "unknown command " + f[0] + "\n"
		}
	})
}

func table(name string) (*Table, error) {
	for _, t := range Tables() {
		if t.Name == name {
			return &t, nil
		}
	}
	return nil, fmt.Errorf("no table %q", name)
}

func parseLog(args []string) ([]Entry, error) {
	seq := uint64(1)
	var log []Entry
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "from="); ok {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return nil, err
			}
			seq = n
			continue
		}
		name, opName, _ := strings.Cut(a, "/")
		e := Entry{Seq: seq, Tag: name}
		if p, err := ParsePhase(name); err == nil {
			e.Op = p.Op()
		}
		if opName != "" {
			op, err := parseOp(opName)
			if err != nil {
				return nil, err
			}
			e.Op = op
		}
		log = append(log, e)
		seq++
	}
	return log, nil
}

func parseOp(name string) (dist.Op, error) {
	for op := dist.OpNone; op <= dist.OpBarrier; op++ {
		if op.String() == name {
			return op, nil
		}
	}
	return 0, fmt.Errorf("no op %q", name)
}

// TestDocHoldsTables: the package doc shows every table as it prints, so
// the doc cannot drift from the order the executor runs.
func TestDocHoldsTables(t *testing.T) {
	src, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	blocks := map[string]string{"the phase list": PhaseList()}
	for _, tb := range Tables() {
		blocks["the "+tb.Name+" table"] = tb.String()
	}
	for name, text := range blocks {
		var want strings.Builder
		for _, l := range strings.Split(strings.TrimRight(text, "\n"), "\n") {
			fmt.Fprintf(&want, "//\t%s\n", strings.TrimRight(l, " "))
		}
		if !strings.Contains(string(src), want.String()) {
			t.Errorf("doc.go does not show %s as it prints; want:\n%s", name, want.String())
		}
	}
}

// TestPhaseNames: every phase parses back from its name, and every table
// row is on its phase's communicator with a condition.
func TestPhaseNames(t *testing.T) {
	for _, p := range Phases() {
		if q, err := ParsePhase(p.String()); err != nil || q != p {
			t.Errorf("%v: parses as %v, %v", p, q, err)
		}
	}
	for _, tb := range Tables() {
		if tb.Rows[0].Phase != Input {
			t.Errorf("%s: the first row is %v, want the step input", tb.Name, tb.Rows[0].Phase)
		}
		for i, r := range tb.Rows {
			if r.When == "" || (r.Of != "N" && r.Of != "N-1") {
				t.Errorf("%s row %d: %+v", tb.Name, i+1, r)
			}
		}
	}
}
