package lint

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// A test waits on a condition, never on a sleep: internal/waitfor polls
// one with a bound. A sleep left in a test is there because real time
// must pass (a timer under test runs on the wall clock, a peer must stay
// silent, a synctest bubble's clock moves by sleeping) and says so in a
// comment on the line above it or on its own line.

// sleepsWithoutComment returns "file:line" of each call of time's Sleep in f,
// parsed from src, that has neither a comment of its own lines ending on
// the line above it nor one on its own line.
func sleepsWithoutComment(fset *token.FileSet, rel string, src []byte, f *ast.File) []string {
	timeName := ""
	for _, im := range f.Imports {
		if im.Path.Value == `"time"` {
			timeName = "time"
			if im.Name != nil {
				timeName = im.Name.Name
			}
		}
	}
	if timeName == "" {
		return nil
	}
	above, same := map[int]bool{}, map[int]bool{} // the lines a comment covers
	for _, cg := range f.Comments {
		start, end := fset.Position(cg.Pos()), fset.Position(cg.End())
		same[start.Line] = true
		lineStart := start.Offset - (start.Column - 1)
		if strings.TrimSpace(string(src[lineStart:start.Offset])) == "" {
			above[end.Line] = true // nothing but the comment on its lines
		}
	}
	var bare []string
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok || sel.Sel.Name != "Sleep" {
			return true
		}
		if id, ok := sel.X.(*ast.Ident); !ok || id.Name != timeName {
			return true
		}
		pos := fset.Position(call.Pos())
		if !same[pos.Line] && !above[pos.Line-1] {
			bare = append(bare, rel+":"+strconv.Itoa(pos.Line))
		}
		return true
	})
	return bare
}

// TestSleepsInTestsSayWhy fails on a sleep in a test file with no
// comment saying why nothing but real time will do.
func TestSleepsInTestsSayWhy(t *testing.T) {
	root, _ := moduleRoot(t)
	fset := token.NewFileSet()
	for _, rel := range goFiles(t, root) {
		if !strings.HasSuffix(rel, "_test.go") {
			continue
		}
		src, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, rel, src, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			continue
		}
		for _, at := range sleepsWithoutComment(fset, rel, src, f) {
			t.Errorf("%s: a sleep in a test with no comment on why: wait on the condition with internal/waitfor, or say why real time must pass", at)
		}
	}
}

// The check itself: a commented sleep passes, a bare one is named, and a
// sleep of another package is none of its business.
func TestSleepsWithoutComment(t *testing.T) {
	src := `package p

import (
	clock "time"
	"other"
)

func f() {
	// Real time for the timer under test.
	clock.Sleep(1)
	clock.Sleep(2) // the peer stays silent
	clock.Sleep(3)
	other.Sleep(4)
}
`
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p_test.go", src, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	// The sleep after one with a comment on its own line is bare.
	if got := strings.Join(sleepsWithoutComment(fset, "p_test.go", []byte(src), f), " "); got != "p_test.go:12" {
		t.Errorf("bare sleeps %q, want p_test.go:12", got)
	}
}
