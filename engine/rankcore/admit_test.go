package rankcore

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/internal/tracetest"
)

// TestAdmitTraces runs testdata/admit-*.txt: the ranks of a TP group match
// the same joining requests against their own caches, Admit MIN-reduces
// their proposals, and each rank plans what it does with its own match.
// Commands:
//
//	rank D/T...   one more rank's own matches, one per joining request: device and device+host tokens
//	admit         Admit over the ranks given since the last admit: each rank's plan, and whether
//	              every rank admits each request at the same match
func TestAdmitTraces(t *testing.T) {
	tracetest.Run(t, "testdata/admit-*.txt", func(t *testing.T) func(string) string {
		var ranks [][]Match
		return func(line string) string {
			args := strings.Fields(line)
			switch args[0] {
			case "rank":
				var ms []Match
				for _, a := range args[1:] {
					d, tot, _ := strings.Cut(a, "/")
					dev, err1 := strconv.Atoi(d)
					total, err2 := strconv.Atoi(tot)
					if err1 != nil || err2 != nil || total < dev {
						return "want D/T with T >= D: " + a + "\n"
					}
					ms = append(ms, Match{Device: dev, Total: total})
				}
				if len(ranks) > 0 && len(ms) != len(ranks[0]) {
					return fmt.Sprintf("rank %d: %d matches, rank 0 has %d\n", len(ranks), len(ms), len(ranks[0]))
				}
				ranks = append(ranks, ms)
				return fmt.Sprintf("rank %d: %d requests\n", len(ranks)-1, len(ms))
			case "admit":
				out := admitAll(ranks)
				ranks = nil
				return out
			}
			return "unknown command " + args[0] + "\n"
		}
	})
}

// admitAll runs Admit over the ranks' matches as the group would: each
// proposes, the proposals MIN-reduce, and each plans on the reduced vector.
func admitAll(ranks [][]Match) string {
	if len(ranks) == 0 {
		return "no ranks\n"
	}
	var reduced []int64
	for _, ms := range ranks {
		p := AdmitProposal(ms)
		if reduced == nil {
			reduced = p
			continue
		}
		for i, v := range p {
			reduced[i] = min(reduced[i], v)
		}
	}
	var b strings.Builder
	var first []Admission
	alike := true
	for r, ms := range ranks {
		plan := PlanAdmit(ms, reduced)
		for i, a := range plan {
			fmt.Fprintf(&b, "rank %d: %d: %s\n", r, i, a)
			if first != nil && first[i].Agreed != a.Agreed {
				alike = false
			}
		}
		if first == nil {
			first = plan
		}
	}
	if alike {
		b.WriteString("every rank admits each request alike\n")
	} else {
		b.WriteString("the ranks admit differently\n")
	}
	return b.String()
}

// TestUnstallTraces runs testdata/unstall-*.txt: one unstall, decided a
// waiter at a time while the trace plays the cache, whose free pages grow
// by what each give-up frees. Commands:
//
//	unstall need=N free=F ID[:locked=L][,pinned][,frees=P]...
//	        the waiting queue in order, the head first; a give-up frees P
//	        pages (L unless given: fewer when another holder shares them)
func TestUnstallTraces(t *testing.T) {
	tracetest.Run(t, "testdata/unstall-*.txt", func(t *testing.T) func(string) string {
		return func(line string) string {
			args := strings.Fields(line)
			if args[0] != "unstall" {
				return "unknown command " + args[0] + "\n"
			}
			out, err := runUnstall(args[1:])
			if err != nil {
				return err.Error() + "\n"
			}
			return out
		}
	})
}

func runUnstall(args []string) (string, error) {
	need, free := -1, -1
	var ws []Waiter
	frees := map[uint64]int{}
	for _, a := range args {
		if k, v, ok := strings.Cut(a, "="); ok && !strings.Contains(k, ":") {
			n, err := strconv.Atoi(v)
			if err != nil {
				return "", err
			}
			switch k {
			case "need":
				need = n
			case "free":
				free = n
			default:
				return "", fmt.Errorf("unknown argument %s", a)
			}
			continue
		}
		id, rest, _ := strings.Cut(a, ":")
		var w Waiter
		var err error
		if w.ID, err = strconv.ParseUint(id, 10, 64); err != nil {
			return "", err
		}
		p := -1
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "":
			case "pinned":
				w.Pinned = true
			case "locked", "frees":
				n, err := strconv.Atoi(v)
				if err != nil {
					return "", fmt.Errorf("%s: %w", kv, err)
				}
				if k == "locked" {
					w.Locked = n
				} else {
					p = n
				}
			default:
				return "", fmt.Errorf("unknown key %s", k)
			}
		}
		if p < 0 {
			p = w.Locked
		}
		frees[w.ID] = p
		ws = append(ws, w)
	}
	if need < 0 || free < 0 {
		return "", fmt.Errorf("want need=N free=F")
	}
	var b strings.Builder
	u := StartUnstall(need, ws)
	for {
		w, ok := u.Next(free)
		if !ok {
			break
		}
		free += frees[w.ID]
		fmt.Fprintf(&b, "%d gives up %d locked pages", w.ID, w.Locked)
		if w.Pinned {
			b.WriteString(" and its host pins")
		}
		fmt.Fprintf(&b, ": %d free\n", free)
	}
	p := u.Plan()
	if p.Fits {
		fmt.Fprintf(&b, "the head fits: %d free of %d needed; gave %v\n", p.Free, need, p.Gave)
	} else {
		fmt.Fprintf(&b, "the head does not fit: %d free of %d needed; gave %v\n", p.Free, need, p.Gave)
	}
	return b.String(), nil
}
