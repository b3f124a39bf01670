package lint

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// A package that has been cut into small pieces should stay that way: a
// size guard bounds its functions, its files and the methods of its types,
// so that the next change grows a new piece instead of the old one.

// sizeGuard bounds the non-test Go files of one directory (not its
// subdirectories). A limit of 0 is not checked.
type sizeGuard struct {
	dir               string // slash-separated, relative to the module root
	maxFuncLines      int    // from the func line to the closing brace, both counted
	maxFileLines      int
	maxMethodsPerType int // distinct method names on a named type, across the package
	// held are the types still over maxMethodsPerType, each held at its
	// present number of methods until it is split: it may not grow, and
	// once it shrinks its number must come down with it, until it meets
	// the limit and leaves the list.
	held map[string]int
}

// sizeGuards lists the guarded directories. Add a directory once it meets
// its limits, e.g. {dir: "some/pkg", maxFuncLines: 100, maxFileLines: 600,
// maxMethodsPerType: 25}.
var sizeGuards = []sizeGuard{
	{dir: "internal/router", maxFuncLines: 100},
	{dir: "engine/serve", maxFuncLines: 100, maxFileLines: 600, maxMethodsPerType: 25},
}

// sized is one measured thing: a file, a function or a named type.
type sized struct {
	pos  token.Position // where it is declared (a file: its first line)
	name string         // "file", "func (*T).m", "type T"
	size int            // lines, or methods for a type
}

// pkgSizes is what a guard is checked against: the measures of one
// directory's files.
type pkgSizes struct {
	files, funcs, types []sized
}

// measureSizes measures files, which fset has parsed. A method counts
// once per name on its type, so that a method with variants behind build
// constraints (a cuda file and its stub) is not counted twice.
func measureSizes(fset *token.FileSet, files []*ast.File) pkgSizes {
	var s pkgSizes
	typePos := map[string]token.Position{}
	methods := map[string]map[string]bool{} // type name -> method names
	var firstMethod []sized                 // each type's first method, for a type declared elsewhere
	for _, f := range files {
		tf := fset.File(f.Pos())
		s.files = append(s.files, sized{pos: fset.Position(tf.LineStart(1)), name: "file", size: tf.LineCount()})
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					if ts, ok := spec.(*ast.TypeSpec); ok {
						typePos[ts.Name.Name] = fset.Position(ts.Pos())
					}
				}
			case *ast.FuncDecl:
				start, end := fset.Position(d.Pos()), fset.Position(d.End())
				s.funcs = append(s.funcs, sized{pos: start, name: "func " + funcName(d), size: end.Line - start.Line + 1})
				recv := receiverType(d)
				if recv == "" {
					continue
				}
				if methods[recv] == nil {
					methods[recv] = map[string]bool{}
					firstMethod = append(firstMethod, sized{pos: start, name: recv})
				}
				methods[recv][d.Name.Name] = true
			}
		}
	}
	for _, m := range firstMethod {
		pos, ok := typePos[m.name]
		if !ok {
			pos = m.pos
		}
		s.types = append(s.types, sized{pos: pos, name: "type " + m.name, size: len(methods[m.name])})
	}
	return s
}

// receiverType returns the name of the type a method is declared on, ""
// for a function.
func receiverType(d *ast.FuncDecl) string {
	if d.Recv == nil || len(d.Recv.List) == 0 {
		return ""
	}
	x := d.Recv.List[0].Type
	if star, ok := x.(*ast.StarExpr); ok {
		x = star.X
	}
	switch g := x.(type) { // a generic type's parameters
	case *ast.IndexExpr:
		x = g.X
	case *ast.IndexListExpr:
		x = g.X
	}
	if id, ok := x.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// funcName names a function as Go's tools do: f, T.m or (*T).m.
func funcName(d *ast.FuncDecl) string {
	recv := receiverType(d)
	switch {
	case recv == "":
		return d.Name.Name
	case isPointer(d.Recv.List[0].Type):
		return "(*" + recv + ")." + d.Name.Name
	default:
		return recv + "." + d.Name.Name
	}
}

func isPointer(x ast.Expr) bool {
	_, ok := x.(*ast.StarExpr)
	return ok
}

// violations returns one line per thing in s over a limit of g.
func (s pkgSizes) violations(g sizeGuard) []string {
	var out []string
	check := func(list []sized, limit int, setting, unit string) {
		if limit == 0 {
			return
		}
		for _, m := range list {
			if m.size > limit {
				out = append(out, fmt.Sprintf("%s:%d: %s has %d %s, over the %s of %d for %s",
					m.pos.Filename, m.pos.Line, m.name, m.size, unit, setting, limit, g.dir))
			}
		}
	}
	check(s.files, g.maxFileLines, "maxFileLines", "lines")
	check(s.funcs, g.maxFuncLines, "maxFuncLines", "lines")
	var types []sized
	for _, m := range s.types {
		name := strings.TrimPrefix(m.name, "type ")
		held, ok := g.held[name]
		switch {
		case !ok:
			types = append(types, m)
		case m.size > held:
			out = append(out, fmt.Sprintf("%s:%d: %s has %d methods, over the %d it is held at in %s until it is split",
				m.pos.Filename, m.pos.Line, m.name, m.size, held, g.dir))
		case m.size <= g.maxMethodsPerType:
			out = append(out, fmt.Sprintf("%s:%d: %s has %d methods, within the maxMethodsPerType of %d: take it off the held list of %s",
				m.pos.Filename, m.pos.Line, m.name, m.size, g.maxMethodsPerType, g.dir))
		case m.size < held:
			out = append(out, fmt.Sprintf("%s:%d: %s has %d methods, fewer than the %d it is held at: lower its number in the held list of %s",
				m.pos.Filename, m.pos.Line, m.name, m.size, held, g.dir))
		}
	}
	check(types, g.maxMethodsPerType, "maxMethodsPerType", "methods")
	return out
}

// parseDir parses the non-test Go files directly in dir (relative to
// root), naming each by its path from the module root.
func parseDir(t *testing.T, root, dir string, all []string) (*token.FileSet, []*ast.File) {
	t.Helper()
	fset := token.NewFileSet()
	var files []*ast.File
	for _, rel := range all {
		if path.Dir(rel) != dir || strings.HasSuffix(rel, "_test.go") {
			continue
		}
		src, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, rel, src, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	return fset, files
}

// TestSizes applies every size guard.
func TestSizes(t *testing.T) {
	root, _ := moduleRoot(t)
	all := goFiles(t, root)
	for _, g := range sizeGuards {
		t.Run(g.dir, func(t *testing.T) {
			if g.maxFuncLines == 0 && g.maxFileLines == 0 && g.maxMethodsPerType == 0 {
				t.Fatal("the guard sets no limit")
			}
			fset, files := parseDir(t, root, g.dir, all)
			if len(files) == 0 {
				t.Fatalf("no non-test Go files in %s: a guard on nothing passes always", g.dir)
			}
			for _, v := range measureSizes(fset, files).violations(g) {
				t.Error(v)
			}
		})
	}
}

// TestSizeCounting checks the counting itself on a made-up package, so
// that a guard cannot pass by measuring nothing.
func TestSizeCounting(t *testing.T) {
	const a = `package p

type T struct{}

// m is four lines long.
func (t *T) m() {
	_ = 1
	_ = 2
}

func (t T) n() {}

func f() {
	g := func() {
	}
	g()
}
`
	const b = `package p

func (t *T) m() {} // m again, as if behind a build constraint

func (u *U[K]) v() {}

type U[K any] struct{}
`
	fset := token.NewFileSet()
	var files []*ast.File
	for _, in := range []struct{ name, src string }{{"p/a.go", a}, {"p/b.go", b}} {
		f, err := parser.ParseFile(fset, in.name, in.src, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	s := measureSizes(fset, files)
	str := func(list []sized) string {
		var parts []string
		for _, m := range list {
			parts = append(parts, fmt.Sprintf("%s:%d %s %d", m.pos.Filename, m.pos.Line, m.name, m.size))
		}
		return strings.Join(parts, "; ")
	}
	for _, c := range []struct{ what, got, want string }{
		{"files", str(s.files), "p/a.go:1 file 17; p/b.go:1 file 7"},
		{"funcs", str(s.funcs), "p/a.go:6 func (*T).m 4; p/a.go:11 func T.n 1; p/a.go:13 func f 5; p/b.go:3 func (*T).m 1; p/b.go:5 func (*U).v 1"},
		{"types", str(s.types), "p/a.go:3 type T 2; p/b.go:7 type U 1"},
	} {
		if c.got != c.want {
			t.Errorf("%s:\n got %s\nwant %s", c.what, c.got, c.want)
		}
	}

	got := s.violations(sizeGuard{dir: "p", maxFuncLines: 4, maxFileLines: 10, maxMethodsPerType: 1})
	want := []string{
		"p/a.go:1: file has 17 lines, over the maxFileLines of 10 for p",
		"p/a.go:13: func f has 5 lines, over the maxFuncLines of 4 for p",
		"p/a.go:3: type T has 2 methods, over the maxMethodsPerType of 1 for p",
	}
	if !slices.Equal(got, want) {
		t.Errorf("violations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if got := s.violations(sizeGuard{dir: "p"}); len(got) != 0 {
		t.Errorf("with no limits set: %q, want none", got)
	}
	// A held type may not grow, must be lowered as it shrinks, and leaves
	// the list once within the limit.
	for _, c := range []struct {
		max, held int
		want      string
	}{
		{1, 2, ""},
		{2, 2, "p/a.go:3: type T has 2 methods, within the maxMethodsPerType of 2: take it off the held list of p"},
		{1, 1, "p/a.go:3: type T has 2 methods, over the 1 it is held at in p until it is split"},
		{1, 3, "p/a.go:3: type T has 2 methods, fewer than the 3 it is held at: lower its number in the held list of p"},
	} {
		g := sizeGuard{dir: "p", maxMethodsPerType: c.max, held: map[string]int{"T": c.held}}
		if got := strings.Join(s.violations(g), "\n"); got != c.want {
			t.Errorf("limit %d, T held at %d: %q, want %q", c.max, c.held, got, c.want)
		}
	}
}
