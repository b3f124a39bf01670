package dist

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors; returned errors wrap them with the seq and ranks involved.
// Test with errors.Is.
var (
	// ErrMismatch: ranks entered different collectives (op, length or root)
	// at the same seq. The error is a *MismatchError.
	ErrMismatch = errors.New("dist: collective mismatch")
	// ErrGroupBroken: an earlier call failed (a rank's ctx ended in the
	// middle of a collective, or a mismatch); the group cannot be used again.
	ErrGroupBroken = errors.New("dist: group broken")
	// ErrGroupClosed: the group was closed.
	ErrGroupClosed = errors.New("dist: group closed")
	// ErrConcurrentUse: two goroutines called the same Comm at once; the
	// call was refused without consuming a seq.
	ErrConcurrentUse = errors.New("dist: Comm used by two goroutines at once")
)

// Elem is the element type of a collective's buffer.
type Elem uint8

// The element types.
const (
	ElemNone Elem = iota // Barrier
	ElemFloat32
	ElemInt64
	ElemByte
)

func (e Elem) String() string {
	switch e {
	case ElemNone:
		return "none"
	case ElemFloat32:
		return "float32"
	case ElemInt64:
		return "int64"
	case ElemByte:
		return "byte"
	}
	return fmt.Sprintf("Elem(%d)", uint8(e))
}

func (e Elem) size() int {
	switch e {
	case ElemFloat32:
		return 4
	case ElemInt64:
		return 8
	case ElemByte:
		return 1
	}
	return 0
}

// Call describes one rank's side of a collective, as a MismatchError shows it.
type Call struct {
	Rank    int
	Arrived bool // false: the rank had not entered this seq when the error was made
	Op      Op
	Elem    Elem
	Count   int    // elements in the rank's buffer; -1 for a non-root of BroadcastBytes
	Root    int    // broadcast root; -1 for other ops
	Out     int    // AllGather output length; -1 for other ops
	Tag     string // what the caller called it for (WithTag); "" when untagged
}

func (c Call) String() string {
	if !c.Arrived {
		return fmt.Sprintf("rank %d not arrived", c.Rank)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "rank %d %v", c.Rank, c.Op)
	if c.Root >= 0 {
		fmt.Fprintf(&b, "(root %d)", c.Root)
	}
	switch {
	case c.Elem == ElemNone:
	case c.Count < 0:
		fmt.Fprintf(&b, " %v[?]", c.Elem)
	default:
		fmt.Fprintf(&b, " %v[%d]", c.Elem, c.Count)
	}
	if c.Out >= 0 {
		fmt.Fprintf(&b, " out[%d]", c.Out)
	}
	if c.Tag != "" {
		fmt.Fprintf(&b, " in %s", c.Tag)
	}
	return b.String()
}

// MismatchError reports ranks that entered different collectives at one seq.
// errors.Is(err, ErrMismatch) holds.
type MismatchError struct {
	Seq    uint64
	Reason string // what differs, e.g. "op", "length"
	Calls  []Call // one per rank, in rank order
}

func (e *MismatchError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v at seq %d (%s):", ErrMismatch, e.Seq, e.Reason)
	for i, c := range e.Calls {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte(' ')
		b.WriteString(c.String())
	}
	return b.String()
}

// Unwrap makes errors.Is(err, ErrMismatch) hold.
func (e *MismatchError) Unwrap() error { return ErrMismatch }

func (e *MismatchError) clone() *MismatchError {
	c := *e
	c.Calls = append([]Call(nil), e.Calls...)
	return &c
}
