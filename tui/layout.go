package tui

import (
	"slices"
	"strings"

	"charm.land/lipgloss/v2"
)

// column is one column of a table that fits a width: its header, its
// cells (one per row) and when it goes as the width narrows.
type column struct {
	header string
	cells  []cell
	// drop orders the columns a narrow screen gives up: the highest first;
	// 0 never goes. The ranks panel never drops what identifies a stalled
	// rank (rank, step, Δ, the collective it waits in and for how long).
	drop int
	// spark makes the column a sparkline that narrows to what is left
	// (no narrower than its header) before it goes; spark draws it at a
	// width.
	spark func(width int) []cell
	// sparkHeader names a sparkline of a width: "LAST 20".
	sparkHeader func(width int) string
}

// fit keeps the columns that fit in width cells (0: all), two spaces
// apart, dropping them in their drop order, a sparkline narrowing first
// down to its header's width (sparkHeader); then renders them as a table with the
// header row first.
func (o FrameOptions) fit(cols []column, width, sparkMax int) string {
	return o.fitAll([][]column{cols}, width, sparkMax)[0]
}

// fitAll fits tables of the same columns (the ranks panels of every
// server) to width together, so that they keep the same columns and the
// same sparkline width, and renders each.
func (o FrameOptions) fitAll(tables [][]column, width, sparkMax int) []string {
	kept := make([][]column, len(tables))
	for t, cols := range tables {
		for _, c := range cols {
			if c.spark != nil {
				c.cells, c.header = c.spark(sparkMax), c.sparkHeader(sparkMax)
			}
			kept[t] = append(kept[t], c)
		}
	}
	widest := func() int {
		w := 0
		for _, cols := range kept {
			w = max(w, tableWidth(cols))
		}
		return w
	}
	for len(kept) > 0 && width > 0 && widest() > width {
		// The columns are the same in every table: choose in the first.
		worst := -1
		for i, c := range kept[0] {
			if c.drop > 0 && (worst < 0 || c.drop > kept[0][worst].drop) {
				worst = i
			}
		}
		if worst < 0 {
			break // only what never goes is left: the frame cuts the lines
		}
		if c := kept[0][worst]; c.spark != nil {
			// A sparkline narrows before it goes.
			w := colWidth(c) - (widest() - width)
			if w >= lipgloss.Width(c.sparkHeader(w)) {
				for t := range kept {
					kept[t][worst].cells, kept[t][worst].header = kept[t][worst].spark(w), c.sparkHeader(w)
				}
				continue
			}
		}
		for t := range kept {
			kept[t] = slices.Delete(kept[t], worst, worst+1)
		}
	}
	out := make([]string, len(kept))
	for t, cols := range kept {
		if len(cols) == 0 {
			continue
		}
		rows := [][]cell{nil}
		for _, c := range cols {
			rows[0] = append(rows[0], plain(c.header))
		}
		for i := range cols[0].cells {
			var r []cell
			for _, c := range cols {
				r = append(r, c.cells[i])
			}
			rows = append(rows, r)
		}
		out[t] = o.table(rows)
	}
	return out
}

func colWidth(c column) int {
	w := lipgloss.Width(c.header)
	for _, x := range c.cells {
		w = max(w, lipgloss.Width(x.text))
	}
	return w
}

// tableWidth is the width of the widest line the columns make.
func tableWidth(cols []column) int {
	w := 0
	for i, c := range cols {
		if i > 0 {
			w += 2
		}
		w += colWidth(c)
	}
	return w
}

// columns turns a table's rows (the header first) into columns, each with
// the drop order its header has in drop (0: it never goes).
func columns(rows [][]cell, drop map[string]int) []column {
	if len(rows) == 0 {
		return nil
	}
	cols := make([]column, len(rows[0]))
	for i, h := range rows[0] {
		cols[i].header = h.text
		cols[i].drop = drop[h.text]
		for _, r := range rows[1:] {
			cols[i].cells = append(cols[i].cells, r[i])
		}
	}
	return cols
}

// lines splits a rendered block into its lines, without the last newline.
func lines(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
}
