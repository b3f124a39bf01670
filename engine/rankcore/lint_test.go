package rankcore

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The core's rules, held by reading its source: what every rank holds
// alike stays alike only if nothing rank-local comes in. A Core method
// takes agreed values only, named by their types below (a pool, a cache's
// match, a socket or a clock reading is none of them); the package
// starts no goroutine, reads no clock, takes no lock and draws no random
// number; it imports nothing that does I/O.

// agreedTypes are the parameter types a Core method may take: values
// from the step input and the broadcast results, agreed capacities, the
// agreed plan and what the core itself answered.
var agreedTypes = []string{
	"uint64", "[]uint64", "int", "time.Duration", // ids and counts of the input, its clock
	"int32", // a token: rank 0 asks Stops of the token it then broadcasts
	"sched.Request", "sched.Plan", "[]sched.Outcome", "[]sched.Finish",
	"Capacity", "Seq", "[]Sampled", "Sample", "[]Forked",
}

// allowedImports are what the package's files may import.
var allowedImports = []string{
	"fmt", "hash/fnv", "maps", "slices", "strings", "text/tabwriter", "time",
	"github.com/pdkit/pdkit/engine/dist", // the names of the collective operations
	"github.com/pdkit/pdkit/engine/sched",
}

// banned are calls and selectors the package must not use.
var banned = []string{"time.Now", "time.Since", "time.Until", "time.Sleep", "time.After", "time.NewTimer", "time.Tick"}

// lintCore checks the package's non-test files, given as name → source.
func lintCore(files map[string]string) []string {
	var bad []string
	fset := token.NewFileSet()
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for k := range files {
			if !yield(k) {
				return
			}
		}
	}) {
		f, err := parser.ParseFile(fset, name, files[name], 0)
		if err != nil {
			bad = append(bad, err.Error())
			continue
		}
		for _, im := range f.Imports {
			path, _ := strconv.Unquote(im.Path.Value)
			if !slices.Contains(allowedImports, path) {
				bad = append(bad, fmt.Sprintf("%s imports %s", name, path))
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.GoStmt:
				bad = append(bad, fmt.Sprintf("%s: starts a goroutine", fset.Position(n.Pos())))
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok && slices.Contains(banned, x.Name+"."+n.Sel.Name) {
					bad = append(bad, fmt.Sprintf("%s: %s.%s reads or waits on the clock", fset.Position(n.Pos()), x.Name, n.Sel.Name))
				}
			case *ast.FuncDecl:
				if !isCoreMethod(n) || !n.Name.IsExported() {
					return true
				}
				for _, p := range n.Type.Params.List {
					if t := exprString(p.Type); !slices.Contains(agreedTypes, t) {
						bad = append(bad, fmt.Sprintf("%s: Core.%s takes a %s, which is no agreed value", fset.Position(p.Pos()), n.Name.Name, t))
					}
				}
			}
			return true
		})
	}
	return bad
}

func isCoreMethod(fn *ast.FuncDecl) bool {
	if fn.Recv == nil || len(fn.Recv.List) != 1 {
		return false
	}
	t := fn.Recv.List[0].Type
	if s, ok := t.(*ast.StarExpr); ok {
		t = s.X
	}
	id, ok := t.(*ast.Ident)
	return ok && id.Name == "Core"
}

// exprString prints a parameter's type as written.
func exprString(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name
	case *ast.SelectorExpr:
		return exprString(e.X) + "." + e.Sel.Name
	case *ast.StarExpr:
		return "*" + exprString(e.X)
	case *ast.ArrayType:
		return "[]" + exprString(e.Elt)
	case *ast.FuncType:
		return "func"
	case *ast.MapType:
		return "map[" + exprString(e.Key) + "]" + exprString(e.Value)
	}
	return fmt.Sprintf("%T", e)
}

func TestCoreTakesAgreedValuesOnly(t *testing.T) {
	paths, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{}
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		files[p] = string(b)
	}
	if _, ok := files["core.go"]; !ok {
		t.Fatal("no core.go: the lint reads nothing")
	}
	for _, b := range lintCore(files) {
		t.Error(b)
	}
}

// The lint finds each kind of breach.
func TestCoreLintCatches(t *testing.T) {
	src := `package rankcore
import (
	"time"
	"github.com/pdkit/pdkit/engine/kvcache"
)
type Core struct{}
func (c *Core) Grow(pool *kvcache.Pool, free int) {}
func (c *Core) Wait() { go func() {}(); _ = time.Now() }
func (c *Core) fine(pool *kvcache.Pool) {}
`
	got := strings.Join(lintCore(map[string]string{"bad.go": src}), "\n")
	for _, want := range []string{
		"bad.go imports github.com/pdkit/pdkit/engine/kvcache",
		"Core.Grow takes a *kvcache.Pool, which is no agreed value",
		"starts a goroutine",
		"time.Now reads or waits on the clock",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the lint missed %q; it said:\n%s", want, got)
		}
	}
	if strings.Contains(got, "Core.fine") {
		t.Errorf("an unexported helper was held to the rule: %s", got)
	}
}
