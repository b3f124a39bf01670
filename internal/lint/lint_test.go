package lint

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"go/format"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// moduleRoot walks up from the working directory to the directory holding
// go.mod and returns it with the module path.
func moduleRoot(t *testing.T) (dir, modPath string) {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil {
			for line := range strings.Lines(string(data)) {
				if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
					return dir, strings.Trim(strings.TrimSpace(rest), `"`)
				}
			}
			t.Fatalf("%s/go.mod has no module line", dir)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the working directory")
		}
		dir = parent
	}
}

// goFiles returns the .go files of the module, relative to root, skipping
// what the go command skips (testdata, hidden and _ directories, nested
// modules) and the build output in bin/.
func goFiles(t *testing.T, root string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() {
			if rel == "." {
				return nil
			}
			name := d.Name()
			if name == "testdata" || name == "vendor" || rel == "bin" ||
				strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(rel, ".go") && d.Type().IsRegular() {
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// TestGofmt fails on every Go file that gofmt would change.
func TestGofmt(t *testing.T) {
	root, _ := moduleRoot(t)
	for _, rel := range goFiles(t, root) {
		src, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			t.Fatal(err)
		}
		got, err := format.Source(src)
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			continue
		}
		if !bytes.Equal(got, src) {
			t.Errorf("%s is not gofmt-formatted; run: gofmt -w %s", rel, rel)
		}
	}
}

// pkgImports maps a package (its directory relative to the module root,
// "." for the root) to the paths it imports, each with the file that
// imports it.
type pkgImports map[string]map[string]string

// readImports parses the imports of the module's Go files. Build
// constraints are ignored, so a file behind any tag counts, except the
// files marked "//go:build ignore", which belong to no package. With tests
// false, _test.go files are left out: they do not reach the binaries.
func readImports(t *testing.T, root string, files []string, tests bool) pkgImports {
	t.Helper()
	pkgs := pkgImports{}
	fset := token.NewFileSet()
	for _, rel := range files {
		if !tests && strings.HasSuffix(rel, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(root, rel), nil, parser.ImportsOnly|parser.ParseComments)
		if err != nil {
			t.Errorf("%v", err)
			continue
		}
		ignored := false
		for _, g := range f.Comments {
			if g.Pos() >= f.Package {
				break
			}
			for _, c := range g.List {
				if expr, ok := strings.CutPrefix(c.Text, "//go:build "); ok && strings.TrimSpace(expr) == "ignore" {
					ignored = true
				}
			}
		}
		if ignored {
			continue
		}
		dir := path.Dir(rel)
		if pkgs[dir] == nil {
			pkgs[dir] = map[string]string{}
		}
		for _, spec := range f.Imports {
			p, err := strconv.Unquote(spec.Path.Value)
			if err != nil {
				t.Errorf("%s: bad import %s", rel, spec.Path.Value)
				continue
			}
			if _, seen := pkgs[dir][p]; !seen {
				pkgs[dir][p] = rel
			}
		}
	}
	return pkgs
}

// under reports whether the slash-separated path p is prefix or inside it.
func under(p, prefix string) bool {
	return p == prefix || strings.HasPrefix(p, prefix+"/")
}

// The operator side talks to servers only through the api package: it must
// not reach the engine, the kernels or cgo, so that pdctl builds with
// CGO_ENABLED=0 and cannot share state with a server by accident.
var (
	operatorDirs      = []string{"cmd/pdctl", "tui", "diag", "api"}
	operatorForbidden = []string{"engine", "kernels"} // relative to the module path
	// gorgonia.org/cu exits the process from its init when no GPU is
	// present, so only the cuda kernels, behind their build tag, may use it.
	cudaImport = "gorgonia.org/cu"
	cudaDir    = "kernels/cuda"
)

// operatorViolations walks, for every operator-side package, everything it
// reaches inside the module and returns one line per forbidden import found,
// with the chain of packages that leads to it.
func operatorViolations(pkgs pkgImports, modPath string) []string {
	forbidden := func(imp string) bool {
		if imp == "C" || under(imp, cudaImport) {
			return true
		}
		for _, f := range operatorForbidden {
			if under(imp, modPath+"/"+f) {
				return true
			}
		}
		return false
	}
	local := func(imp string) (string, bool) {
		if imp == modPath {
			return ".", true
		}
		rel, ok := strings.CutPrefix(imp, modPath+"/")
		return rel, ok
	}
	var out []string
	var dirs []string
	for dir := range pkgs {
		dirs = append(dirs, dir)
	}
	sort.Strings(dirs)
	for _, start := range dirs {
		if !slices.ContainsFunc(operatorDirs, func(d string) bool { return under(start, d) }) {
			continue
		}
		// Depth-first over the module's packages, remembering how each was reached.
		via := map[string]string{start: ""}
		stack := []string{start}
		for len(stack) > 0 {
			dir := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			imps := make([]string, 0, len(pkgs[dir]))
			for imp := range pkgs[dir] {
				imps = append(imps, imp)
			}
			sort.Strings(imps)
			for _, imp := range imps {
				if forbidden(imp) {
					chain := []string{dir}
					for d := via[dir]; d != ""; d = via[d] {
						chain = append(chain, d)
					}
					slices.Reverse(chain)
					out = append(out, fmt.Sprintf("%s imports %q (%s, reached via %s)",
						start, imp, pkgs[dir][imp], strings.Join(chain, " -> ")))
					continue
				}
				if next, ok := local(imp); ok {
					if _, seen := via[next]; !seen {
						via[next] = dir
						stack = append(stack, next)
					}
				}
			}
		}
	}
	return out
}

// cudaViolations returns one line per import of gorgonia.org/cu outside
// kernels/cuda.
func cudaViolations(pkgs pkgImports) []string {
	var out []string
	for dir, imps := range pkgs {
		if under(dir, cudaDir) {
			continue
		}
		for imp, file := range imps {
			if under(imp, cudaImport) {
				out = append(out, fmt.Sprintf("%s imports %q; only %s may", file, imp, cudaDir))
			}
		}
	}
	sort.Strings(out)
	return out
}

// TestImports enforces the direction of the dependencies.
func TestImports(t *testing.T) {
	root, modPath := moduleRoot(t)
	files := goFiles(t, root)
	for _, v := range operatorViolations(readImports(t, root, files, false), modPath) {
		t.Error(v)
	}
	for _, v := range cudaViolations(readImports(t, root, files, true)) {
		t.Error(v)
	}
}

// TestImportRules checks the rules themselves on a made-up module.
func TestImportRules(t *testing.T) {
	const mod = "example.com/m"
	pkgs := pkgImports{
		"cmd/pdctl":    {"fmt": "cmd/pdctl/main.go", mod + "/internal/ctl": "cmd/pdctl/main.go"},
		"internal/ctl": {mod + "/api": "internal/ctl/ctl.go", mod + "/engine/model": "internal/ctl/ctl.go"},
		"api":          {"net/http": "api/client.go"},
		"tui":          {mod + "/api": "tui/app.go", "C": "tui/term.go"},
		"diag/rules":   {mod + "/kernels": "diag/rules/r.go"},
		"engine/model": {mod + "/kernels": "engine/model/m.go"},
		"kernels/cuda": {"gorgonia.org/cu": "kernels/cuda/cuda.go"},
		"internal/gpu": {"gorgonia.org/cu/nvrtc": "internal/gpu/gpu.go"},
	}
	got := operatorViolations(pkgs, mod)
	want := []string{
		`cmd/pdctl imports "example.com/m/engine/model" (internal/ctl/ctl.go, reached via cmd/pdctl -> internal/ctl)`,
		`diag/rules imports "example.com/m/kernels" (diag/rules/r.go, reached via diag/rules)`,
		`tui imports "C" (tui/term.go, reached via tui)`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("operatorViolations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	got = cudaViolations(pkgs)
	want = []string{`internal/gpu/gpu.go imports "gorgonia.org/cu/nvrtc"; only kernels/cuda may`}
	if !slices.Equal(got, want) {
		t.Errorf("cudaViolations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestGoModTidy fails when "go mod tidy" would change go.mod or go.sum.
func TestGoModTidy(t *testing.T) {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	root, _ := moduleRoot(t)
	cmd := exec.CommandContext(t.Context(), goCmd, "mod", "tidy", "-diff")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("go mod tidy -diff: %v\n%s\nrun: go mod tidy", err, out)
	}
}

// Strings that only ever appear when a file names the machine or the
// set-up it was written in rather than the project. They are assembled here
// so that this file does not match them itself.
var environmentStrings = []string{
	"/" + "work" + "/",
	"." + "library",
	"farm" + "-",
}

// projectFiles lists the files that belong in the repository: what git
// tracks plus what it would track (not ignored). Without git, every file
// outside .git and bin/.
func projectFiles(t *testing.T, root string) []string {
	t.Helper()
	if gitCmd, err := exec.LookPath("git"); err == nil {
		cmd := exec.CommandContext(t.Context(), gitCmd, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
		cmd.Dir = root
		if out, err := cmd.Output(); err == nil {
			var files []string
			for f := range strings.SplitSeq(string(out), "\x00") {
				if f != "" {
					files = append(files, f)
				}
			}
			return files
		}
	}
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() && (d.Name() == ".git" || rel == "bin") {
			return filepath.SkipDir
		}
		if d.Type().IsRegular() {
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// TestNoEnvironmentNames fails on text files that name the environment
// they were written in: the project speaks of itself only.
func TestNoEnvironmentNames(t *testing.T) {
	root, _ := moduleRoot(t)
	for _, rel := range projectFiles(t, root) {
		data, err := os.ReadFile(filepath.Join(root, rel))
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted but still in the index
		}
		if err != nil {
			t.Error(err)
			continue
		}
		if bytes.IndexByte(data[:min(len(data), 8000)], 0) >= 0 {
			continue // binary
		}
		sc := bufio.NewScanner(bytes.NewReader(data))
		sc.Buffer(nil, len(data)+1)
		for n := 1; sc.Scan(); n++ {
			for _, s := range environmentStrings {
				if strings.Contains(sc.Text(), s) {
					t.Errorf("%s:%d names its environment (%q)", rel, n, s)
				}
			}
		}
	}
}
