package main

import (
	"runtime"
	"strings"
	"testing"

	"github.com/pdkit/pdkit/engine/serve"
)

// TestResolveSchedule: --schedule auto runs overlap only when the ranks'
// kernel threads leave one of the CPUs Go runs on free (the ref backend
// keeps one thread a rank busy), and says what it saw; a loop named is
// taken as it is, and anything else is a usage error.
func TestResolveSchedule(t *testing.T) {
	cpus := runtime.GOMAXPROCS(0)
	for _, c := range []struct {
		schedule, backend string
		threads, tp       int
		want              string
	}{
		{"auto", "cpu", cpus, 1, serve.ScheduleLockstep},
		{"auto", "cpu", max(1, cpus/2), 2, serve.ScheduleLockstep},
		{"auto", "cpu", cpus - 1, 1, map[bool]string{true: serve.ScheduleOverlap, false: serve.ScheduleLockstep}[cpus > 1]},
		{"auto", "ref", 64, cpus, serve.ScheduleLockstep},
		{"lockstep", "cpu", 1, 1, serve.ScheduleLockstep},
		{"overlap", "cpu", cpus, 1, serve.ScheduleOverlap},
	} {
		got, why, err := resolveSchedule(c.schedule, c.backend, c.threads, c.tp)
		if err != nil || got != c.want {
			t.Errorf("%+v: %q, %v; want %q", c, got, err, c.want)
		}
		if (c.schedule == serve.ScheduleAuto) != strings.HasPrefix(why, "auto: ") {
			t.Errorf("%+v: why %q", c, why)
		}
	}
	if _, _, err := resolveSchedule("Auto", "cpu", 1, 1); err == nil || !strings.Contains(err.Error(), "want lockstep, overlap or auto") {
		t.Errorf("a misspelt schedule: %v", err)
	}
}
