package rankcore

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/internal/tracetest"
)

// TestDrainTraces runs testdata/drain-*.txt through DrainStep. Commands:
//
//	facts [scheduled=N] [rooms=N] [handshaking=N] [seqs=N] [joining=N] [past]
//	held ID [cut] [spared] [forks=ID,ID]   a request rank 0 holds
//	step                                   DrainStep over the facts and the requests held
//	end ID                                 the request is no longer held
func TestDrainTraces(t *testing.T) {
	tracetest.Run(t, "testdata/drain-*.txt", func(t *testing.T) func(string) string {
		var f DrainFacts
		var held []DrainHeld
		return func(line string) string {
			args := strings.Fields(line)
			switch args[0] {
			case "facts":
				f = DrainFacts{}
				for _, a := range args[1:] {
					k, v, _ := strings.Cut(a, "=")
					n, _ := strconv.Atoi(v)
					switch k {
					case "scheduled":
						f.Scheduled = n
					case "rooms":
						f.Rooms = n
					case "handshaking":
						f.Handshaking = n
					case "seqs":
						f.Seqs = n
					case "joining":
						f.Joining = n
					case "past":
						f.PastBound = true
					default:
						return "unknown fact " + k + "\n"
					}
				}
				return fmt.Sprintf("%+v\n", f)
			case "held":
				id, _ := strconv.ParseUint(args[1], 10, 64)
				h := DrainHeld{ID: id}
				for _, a := range args[2:] {
					switch {
					case a == "cut":
						h.Cut = true
					case a == "spared":
						h.Spared = true
					case strings.HasPrefix(a, "forks="):
						for _, s := range strings.Split(strings.TrimPrefix(a, "forks="), ",") {
							n, _ := strconv.ParseUint(s, 10, 64)
							h.Forks = append(h.Forks, n)
						}
					}
				}
				held = append(held, h)
				return fmt.Sprintf("%d requests held\n", len(held))
			case "end":
				id, _ := strconv.ParseUint(args[1], 10, 64)
				for i, h := range held {
					if h.ID == id {
						held = append(held[:i], held[i+1:]...)
						break
					}
				}
				return fmt.Sprintf("%d requests held\n", len(held))
			case "step":
				d := DrainStep(f, held)
				switch {
				case d.Switch:
					return "switch\n"
				case len(d.Cut) > 0:
					return fmt.Sprintf("abort %v\n", d.Cut)
				}
				return "wait\n"
			}
			return "unknown command " + args[0] + "\n"
		}
	})
}
