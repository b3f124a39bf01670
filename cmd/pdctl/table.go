package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// table is the one output helper of every command's human output: on a
// terminal an aligned table under an upper-case header; piped, the rows
// alone, their cells separated by tabs, for cut and awk. Cells must not
// contain tabs or newlines (cell replaces them).
type table struct {
	header   []string
	rows     [][]string
	volatile map[int]bool // columns that change from one run to the next
}

// newTable starts a table with header; columns named in volatile (ages,
// step numbers) are masked when the factory asks for it (tests).
func newTable(header []string, volatile ...string) *table {
	t := &table{header: header, volatile: map[int]bool{}}
	for i, h := range header {
		for _, v := range volatile {
			if h == v {
				t.volatile[i] = true
			}
		}
	}
	return t
}

func (t *table) add(cells ...string) {
	row := make([]string, len(t.header))
	for i := range row {
		if i < len(cells) {
			row[i] = cell(cells[i])
		}
		if row[i] == "" {
			row[i] = "-"
		}
	}
	t.rows = append(t.rows, row)
}

// cell makes s safe for one table cell.
func cell(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '\t' || r == '\n' || r == '\r' {
			return ' '
		}
		return r
	}, s)
}

// print writes the table for a terminal (tty) or a pipe.
func (t *table) print(f *factory) error {
	rows := t.rows
	if f.maskVolatile {
		rows = make([][]string, len(t.rows))
		for i, r := range t.rows {
			rows[i] = append([]string(nil), r...)
			for j := range rows[i] {
				if t.volatile[j] && rows[i][j] != "-" {
					rows[i][j] = "*"
				}
			}
		}
	}
	if !f.OutTTY {
		for _, r := range rows {
			if _, err := fmt.Fprintln(f.Out, strings.Join(r, "\t")); err != nil {
				return err
			}
		}
		return nil
	}
	tw := tabwriter.NewWriter(f.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(t.header, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

// printTables prints several tables, a blank line between two.
func printTables(f *factory, tables ...*table) error {
	for i, t := range tables {
		if i > 0 {
			if _, err := io.WriteString(f.Out, "\n"); err != nil {
				return err
			}
		}
		if err := t.print(f); err != nil {
			return err
		}
	}
	return nil
}
