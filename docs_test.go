package servicefabric

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// readRepo reads a file of the repository (tests run in the module root).
func readRepo(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// testFuncs returns the names of every top-level func in every _test.go
// file of the repository, the test modules (test/otelcol, bench/...)
// included.
func testFuncs(t *testing.T) map[string]bool {
	t.Helper()
	decl := regexp.MustCompile(`(?m)^func (\w+)\(`)
	funcs := map[string]bool{}
	err := filepath.WalkDir(".", func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.IsDir() && strings.HasPrefix(e.Name(), ".") && path != "." {
			return filepath.SkipDir
		}
		if e.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range decl.FindAllStringSubmatch(string(b), -1) {
			funcs[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return funcs
}

// readmeProofs returns the test, benchmark, fuzz and example names the
// proof column (the third) of README's "What works today" table lists,
// as written: a trailing * stands for every name with that prefix.
func readmeProofs(readme string) []string {
	name := regexp.MustCompile("`((?:Test|Benchmark|Fuzz|Example)\\w*\\*?)`")
	var out []string
	for _, line := range strings.Split(readme, "\n") {
		cols := strings.Split(line, "|")
		if !strings.HasPrefix(line, "|") || len(cols) < 5 {
			continue
		}
		for _, m := range name.FindAllStringSubmatch(cols[3], -1) {
			out = append(out, m[1])
		}
	}
	return out
}

// TestReadmeProofsExist: every test the README names as the proof of a
// part exists, so the table cannot point at a test that was renamed or
// never written.
func TestReadmeProofsExist(t *testing.T) {
	proofs := readmeProofs(readRepo(t, "README.md"))
	if len(proofs) < 50 {
		t.Fatalf("found %d test names in README's proof column; the table's shape changed?", len(proofs))
	}
	funcs := testFuncs(t)
	for _, p := range proofs {
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			found := false
			for f := range funcs {
				if strings.HasPrefix(f, prefix) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("README names %s: no test function starts with %s", p, prefix)
			}
			continue
		}
		if !funcs[p] {
			t.Errorf("README names %s: no such test function", p)
		}
	}
}

// TestReadmeProofsParse checks the parser on a made-up table, so that a
// change of the table's shape cannot make the test above vacuous.
func TestReadmeProofsParse(t *testing.T) {
	table := "| part | state | proof |\n|---|---|---|\n| a | `TestNot` here | `TestA`, `BenchmarkB*`, `go test ./x/`, `FuzzC` |\nnot a row `TestD`\n"
	got := strings.Join(readmeProofs(table), ",")
	if want := "TestA,BenchmarkB*,FuzzC"; got != want {
		t.Fatalf("readmeProofs = %s, want %s", got, want)
	}
}

// TestGoVersionAgrees: the minimum Go version is go.mod's go line, and
// README and .ci/run (which refuses an older toolchain) name the same
// major.minor.
func TestGoVersionAgrees(t *testing.T) {
	m := regexp.MustCompile(`(?m)^go (1\.\d+)(\.\d+)?$`).FindStringSubmatch(readRepo(t, "go.mod"))
	if m == nil {
		t.Fatal("go.mod has no go line")
	}
	min := m[1]
	for _, c := range []struct {
		file string
		re   string
	}{
		{"README.md", `Go (1\.\d+)(?:\+| or newer)`},
		{".ci/run", `need Go >= (1\.\d+)`},
	} {
		all := regexp.MustCompile(c.re).FindAllStringSubmatch(readRepo(t, c.file), -1)
		if len(all) == 0 {
			t.Errorf("%s states no minimum Go version (looked for %s)", c.file, c.re)
		}
		for _, v := range all {
			if v[1] != min {
				t.Errorf("%s says Go %s; go.mod's minimum is %s", c.file, v[1], min)
			}
		}
	}
}
