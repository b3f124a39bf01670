package rankcore

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/internal/tracetest"
)

// TestForkTraces runs testdata/forks-*.txt: one rank's fork budgets and
// the plans of its fork phases, as the executor spends them. Commands:
//
//	expect PARENT N                       a request of N samples arrives
//	pending                               the budgets, by parent
//	take PARENT                           the parent's first token spends its budget (a PD arrival's)
//	drop PARENT                           the parent ends: the samples that end with it
//	first pages=P rows=R page=S PARENT:prompt=L,max=M,firsts=FLAGS...
//	                                      fork: take each parent's budget and plan its samples; FLAGS has
//	                                      one letter per sample, x when its first token stops it, . if not
//	arrivals pages=P rows=R page=S PARENT:prompt=L,samples=K[,gone]...
//	                                      pd_fork: plan the decode arrivals' samples (taken at their arrival)
func TestForkTraces(t *testing.T) {
	tracetest.Run(t, "testdata/forks-*.txt", func(t *testing.T) func(string) string {
		var f Forks
		return func(line string) string {
			out, err := runForks(&f, strings.Fields(line))
			if err != nil {
				return err.Error() + "\n"
			}
			return out
		}
	})
}

func runForks(f *Forks, args []string) (string, error) {
	switch args[0] {
	case "expect":
		p, err := uintArg(args, 1)
		if err != nil {
			return "", err
		}
		n, err := strconv.Atoi(args[2])
		if err != nil {
			return "", err
		}
		f.Expect(p, n)
		return fmt.Sprintf("%d: %d pending\n", p, f.Pending(p)), nil
	case "pending":
		if f.Len() == 0 {
			return "none\n", nil
		}
		var b strings.Builder
		for _, p := range slices.Sorted(maps.Keys(f.pending)) {
			fmt.Fprintf(&b, "%d: %d\n", p, f.Pending(p))
		}
		return b.String(), nil
	case "take":
		p, err := uintArg(args, 1)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("%d: took %d\n", p, f.Take(p)), nil
	case "drop":
		p, err := uintArg(args, 1)
		if err != nil {
			return "", err
		}
		ids := f.Drop(p)
		if len(ids) == 0 {
			return fmt.Sprintf("%d: nothing pending\n", p), nil
		}
		return fmt.Sprintf("%d: ends %s\n", p, strings.ReplaceAll(strings.Trim(fmt.Sprint(ids), "[]"), " ", ", ")), nil
	case "first", "arrivals":
		room, page, specs, err := roomArgs(args[1:])
		if err != nil {
			return "", err
		}
		if args[0] == "arrivals" {
			as := make([]Arrival, 0, len(specs))
			for _, s := range specs {
				as = append(as, Arrival{Parent: s.parent, Samples: s.samples, Prompt: s.prompt, Held: !s.gone})
			}
			return PlanArrivalForks(room, page, as).String(), nil
		}
		var b strings.Builder
		var fs []First
		for _, s := range specs {
			k := f.Take(s.parent)
			if k == 0 {
				fmt.Fprintf(&b, "%d: nothing pending\n", s.parent)
				continue
			}
			if k != len(s.firsts) {
				return "", fmt.Errorf("%d: %d pending, %d first tokens", s.parent, k, len(s.firsts))
			}
			stops := make([]bool, k)
			for i, c := range s.firsts {
				stops[i] = c == 'x'
			}
			fs = append(fs, First{Parent: s.parent, Prompt: s.prompt, MaxTokens: s.max, Stops: stops})
		}
		b.WriteString(PlanFirstForks(room, page, fs).String())
		return b.String(), nil
	}
	return "", fmt.Errorf("unknown command %s", args[0])
}

func uintArg(args []string, i int) (uint64, error) {
	if len(args) <= i {
		return 0, fmt.Errorf("%s: want an id", args[0])
	}
	return strconv.ParseUint(args[i], 10, 64)
}

// parentSpec is one PARENT:key=value,... argument.
type parentSpec struct {
	parent               uint64
	prompt, max, samples int
	firsts               string
	gone                 bool
}

func roomArgs(args []string) (room Capacity, page int, specs []parentSpec, err error) {
	for _, a := range args {
		if k, v, ok := strings.Cut(a, "="); ok && !strings.Contains(k, ":") {
			n, err := strconv.Atoi(v)
			if err != nil {
				return room, 0, nil, err
			}
			switch k {
			case "pages":
				room.Pages = n
			case "rows":
				room.Rows = n
			case "page":
				page = n
			default:
				return room, 0, nil, fmt.Errorf("unknown argument %s", a)
			}
			continue
		}
		id, rest, _ := strings.Cut(a, ":")
		var s parentSpec
		if s.parent, err = strconv.ParseUint(id, 10, 64); err != nil {
			return room, 0, nil, err
		}
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			if k == "gone" {
				s.gone = true
				continue
			}
			if k == "firsts" {
				s.firsts = v
				continue
			}
			n, err := strconv.Atoi(v)
			if err != nil {
				return room, 0, nil, fmt.Errorf("%s: %w", kv, err)
			}
			switch k {
			case "prompt":
				s.prompt = n
			case "max":
				s.max = n
			case "samples":
				s.samples = n
			default:
				return room, 0, nil, fmt.Errorf("unknown key %s", k)
			}
		}
		specs = append(specs, s)
	}
	if page < 1 {
		return room, 0, nil, fmt.Errorf("want page=S, S > 0")
	}
	return room, page, specs, nil
}
