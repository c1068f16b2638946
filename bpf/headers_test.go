package bpf

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// maxHeaderLines is the longest a header may be (under lib/, and the
// layouts shared with Go in this directory): one stage, feature or concern
// per header, readable top to bottom (docs/architecture.md).
const maxHeaderLines = 500

// headerContexts are the packet contexts every header must compile in:
// TC (skb) and XDP. A header with nothing for one context (ha.h's queue,
// lb_send_xdp.h) compiles to nothing there.
var headerContexts = []struct {
	name    string
	prelude string
}{
	{"skb", ""},
	{"xdp", "#define FLUXVM_CTX_XDP 1\n"},
}

// libHeaders returns the headers under lib/ (the context layer, lib/ctx/,
// included), relative to this directory.
func libHeaders(t *testing.T) []string {
	t.Helper()
	var hs []string
	err := filepath.WalkDir("lib", func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".h") {
			hs = append(hs, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) == 0 {
		t.Fatal("no headers under lib/")
	}
	slices.Sort(hs)
	return hs
}

// abiHeaders returns the headers in this directory: the layouts shared
// with Go (fluxvm_service_v6.bpf.h and the types headers it includes) and
// the map capacities (fluxvm_service_maps.bpf.h).
func abiHeaders(t *testing.T) []string {
	t.Helper()
	hs, err := filepath.Glob("*.h")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(hs, "fluxvm_service_v6.bpf.h") {
		t.Fatalf("no fluxvm_service_v6.bpf.h among the headers in bpf/: %v", hs)
	}
	slices.Sort(hs)
	return hs
}

// bpfCFlags returns the compiler flags of the TC object's go:generate line
// in gen.go (everything after its "--"), so the headers are checked as
// they are built.
func bpfCFlags(t *testing.T) []string {
	t.Helper()
	src, err := os.ReadFile("gen.go")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "//go:generate") || !strings.Contains(line, " fluxvm_service.bpf.c -- ") {
			continue
		}
		_, flags, _ := strings.Cut(line, " fluxvm_service.bpf.c -- ")
		return strings.Fields(flags)
	}
	t.Fatal("gen.go has no go:generate line for fluxvm_service.bpf.c")
	return nil
}

// requireClang returns the path of clang, or skips (fails under
// FLUXVM_REQUIRE_PRIVILEGED=1, as CI sets) when it or the libbpf headers
// are missing.
func requireClang(t *testing.T) string {
	t.Helper()
	problem := ""
	clang, err := exec.LookPath("clang")
	if err != nil {
		problem = "clang not found (apt-get install clang)"
	} else if _, err := os.Stat("/usr/include/bpf/bpf_helpers.h"); err != nil {
		problem = "libbpf headers not found (apt-get install libbpf-dev)"
	}
	if problem == "" {
		return clang
	}
	if testenv.Required() {
		t.Fatalf("%s: the BPF headers cannot be checked (%s=1 is set, so this fails instead of skipping)", problem, testenv.RequireEnv)
	}
	t.Skipf("%s: skipping the BPF header checks (set %s=1 to make this a failure)", problem, testenv.RequireEnv)
	return ""
}

// TestHeadersStandalone compiles every header under lib/ on its own after
// the context layer (lib/common.h), in each packet context, and every
// header in this directory (the layouts shared with Go) with nothing
// before it: a header that uses a function, type or constant of another
// must include it, so none depends on what an entry object happened to
// include before it.
func TestHeadersStandalone(t *testing.T) {
	clang := requireClang(t)
	flags := bpfCFlags(t)
	compile := func(t *testing.T, h, context, tu string) {
		t.Parallel()
		args := append([]string{"-target", "bpf", "-fsyntax-only", "-I", "."}, flags...)
		args = append(args, "-x", "c", "-")
		cmd := exec.Command(clang, args...)
		cmd.Stdin = strings.NewReader(tu)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s does not compile on its own in the %s context (it must include what it uses): %v\n%s",
				h, context, err, out)
		}
	}
	for _, h := range abiHeaders(t) {
		t.Run("abi/"+h, func(t *testing.T) {
			compile(t, h, "abi (nothing before it)", fmt.Sprintf("#include %q\n", h))
		})
	}
	for _, h := range libHeaders(t) {
		if strings.HasPrefix(h, filepath.Join("lib", "ctx")+string(filepath.Separator)) {
			continue // the context layer itself, included by common.h
		}
		for _, c := range headerContexts {
			t.Run(c.name+"/"+filepath.Base(h), func(t *testing.T) {
				compile(t, h, c.name, fmt.Sprintf("%s#include \"lib/common.h\"\n#include %q\n", c.prelude, filepath.ToSlash(h)))
			})
		}
	}
}

// TestHeaderLength keeps every header under lib/ and in this directory at
// most maxHeaderLines long: a header past it holds more than one stage (or,
// for the layouts shared with Go, more than one concern) and is split.
func TestHeaderLength(t *testing.T) {
	for _, h := range append(abiHeaders(t), libHeaders(t)...) {
		src, err := os.ReadFile(h)
		if err != nil {
			t.Fatal(err)
		}
		if n := bytes.Count(src, []byte("\n")); n > maxHeaderLines {
			t.Errorf("%s is %d lines, over %d: split it by stage (types in a header of their own)", h, n, maxHeaderLines)
		}
	}
}
