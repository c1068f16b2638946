package servicefabric

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const (
	module = "github.com/fluxvm/servicefabric"
	facade = module + "/fluxvm"
	// maxFacadeFile bounds the lines of one source file of package fluxvm
	// (the facade), maxComponent those of one component's sources
	// (tests aside): issue 35.
	maxFacadeFile = 400
	maxComponent  = 1500
)

// facadeTooLong are the facade's files over maxFacadeFile, each with the
// lines it may not grow past; a file leaves the list when it is split,
// and the list only shrinks. Empty since the services' programming moved
// into fluxvm/internal/services (issue 35).
var facadeTooLong = map[string]int{}

// goSources lists the non-test Go files of dir (not below it).
func goSources(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		if n := e.Name(); !e.IsDir() && strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") {
			out = append(out, filepath.Join(dir, n))
		}
	}
	return out
}

func lines(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "\n")
}

// imports lists the module's packages that the non-test files of dir
// import.
func imports(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, f := range goSources(t, dir) {
		af, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, im := range af.Imports {
			p, _ := strconv.Unquote(im.Path.Value)
			if strings.HasPrefix(p, module+"/") && !slices.Contains(out, p) {
				out = append(out, p)
			}
		}
	}
	return out
}

// TestFacadeAndComponentsShape checks the shape issue 35 gives package
// fluxvm: no facade file over maxFacadeFile lines (but those listed,
// which may only shrink), no component over maxComponent, and no
// component importing the facade, directly or through other packages of
// the module.
func TestFacadeAndComponentsShape(t *testing.T) {
	for _, f := range goSources(t, "fluxvm") {
		n, name := lines(t, f), filepath.Base(f)
		limit, listed := facadeTooLong[name]
		switch {
		case !listed && n > maxFacadeFile:
			t.Errorf("fluxvm/%s: %d lines, over %d: split it, or move what it does into a component", name, n, maxFacadeFile)
		case listed && n > limit:
			t.Errorf("fluxvm/%s: %d lines, more than the %d it had (it is to shrink, not grow)", name, n, limit)
		case listed && n <= maxFacadeFile:
			t.Errorf("fluxvm/%s: %d lines now: take it off facadeTooLong", name, n)
		}
	}
	es, err := os.ReadDir("fluxvm/internal")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join("fluxvm/internal", e.Name())
		total := 0
		for _, f := range goSources(t, dir) {
			total += lines(t, f)
		}
		if total > maxComponent {
			t.Errorf("%s: %d lines, over %d", dir, total, maxComponent)
		}
		// The module's packages it reaches, breadth first.
		seen := map[string]bool{}
		queue := []string{module + "/" + dir}
		for len(queue) > 0 {
			p := queue[0]
			queue = queue[1:]
			for _, im := range imports(t, strings.TrimPrefix(p, module+"/")) {
				if im == facade {
					t.Errorf("%s reaches the facade (%s imports it)", dir, p)
				}
				if !seen[im] {
					seen[im] = true
					queue = append(queue, im)
				}
			}
		}
	}
}
