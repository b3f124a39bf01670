package client

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// MetricSample is one sample line of a Prometheus text exposition: the
// metric's name, its labels and its value.
type MetricSample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// ParseMetrics returns the samples of the metrics named in names (every
// sample when names is empty) from a Prometheus text exposition, as GET
// /metrics answers it (Client.Metrics), in the order they appear. Comment
// and blank lines are skipped; a sample line it cannot read is an error
// naming its line.
func ParseMetrics(text string, names ...string) ([]MetricSample, error) {
	var out []MetricSample
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		name := line
		if j := strings.IndexAny(line, "{ \t"); j >= 0 {
			name = line[:j]
		}
		if len(names) > 0 && !slices.Contains(names, name) {
			continue
		}
		s, err := parseSample(line, name)
		if err != nil {
			return nil, fmt.Errorf("metrics line %d: %w: %q", i+1, err, line)
		}
		out = append(out, s)
	}
	return out, nil
}

// parseSample reads name{labels} value [timestamp].
func parseSample(line, name string) (MetricSample, error) {
	s := MetricSample{Name: name, Labels: map[string]string{}}
	rest := line[len(name):]
	if strings.HasPrefix(rest, "{") {
		rest = rest[1:]
		for {
			rest = strings.TrimLeft(rest, " \t")
			if strings.HasPrefix(rest, "}") {
				rest = rest[1:]
				break
			}
			eq := strings.IndexByte(rest, '=')
			if eq <= 0 || len(rest) < eq+2 || rest[eq+1] != '"' {
				return s, fmt.Errorf("bad label")
			}
			key := strings.TrimSpace(rest[:eq])
			rest = rest[eq+2:]
			var val strings.Builder
			closed := false
			for j := 0; j < len(rest); j++ {
				c := rest[j]
				if c == '\\' && j+1 < len(rest) {
					j++
					switch rest[j] {
					case 'n':
						val.WriteByte('\n')
					default:
						val.WriteByte(rest[j])
					}
					continue
				}
				if c == '"' {
					rest, closed = rest[j+1:], true
					break
				}
				val.WriteByte(c)
			}
			if !closed {
				return s, fmt.Errorf("unterminated label value")
			}
			s.Labels[key] = val.String()
			rest = strings.TrimLeft(rest, " \t")
			rest = strings.TrimPrefix(rest, ",")
		}
	}
	fields := strings.Fields(rest)
	if len(fields) < 1 || len(fields) > 2 {
		return s, fmt.Errorf("want a value and an optional timestamp")
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, fmt.Errorf("bad value %q", fields[0])
	}
	s.Value = v
	return s, nil
}
