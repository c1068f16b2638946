package intent

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// portable are the packages that must build on every OS, so that a
// control plane on macOS or Windows can decode and validate intent, lay
// out Maglev tables, read advertisements and probe health as the node
// does.
var portable = []string{"./intent", "./maglev", "./advert", "./health"}

// linuxOnly are the import paths (prefixes) a portable package must not
// depend on: the BPF loader and the maps, netlink, and x/sys/unix.
var linuxOnly = []string{
	"github.com/cilium/ebpf",
	"github.com/vishvananda/",
	"golang.org/x/sys/unix",
	"github.com/fluxvm/servicefabric/bpf",
	"github.com/fluxvm/servicefabric/conntrack",
	"github.com/fluxvm/servicefabric/nat",
	"github.com/fluxvm/servicefabric/fluxvm",
	"github.com/fluxvm/servicefabric/internal/bpffs",
}

// TestPortableDependencies lists the dependencies of the portable
// packages as macOS, Windows and FreeBSD builds see them and fails on any
// Linux-only one. (.ci/run also cross-compiles them.)
func TestPortableDependencies(t *testing.T) {
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	for _, goos := range []string{"darwin", "windows", "freebsd"} {
		t.Run(goos, func(t *testing.T) {
			cmd := exec.Command(goBin, append([]string{"list", "-deps", "-f", "{{.ImportPath}}"}, portable...)...)
			cmd.Dir = ".."
			cmd.Env = append(os.Environ(), "GOOS="+goos, "GOARCH=amd64", "CGO_ENABLED=0")
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("go list: %v\n%s", err, out)
			}
			deps := strings.Fields(string(out))
			if len(deps) < len(portable) {
				t.Fatalf("go list listed %d packages:\n%s", len(deps), out)
			}
			for _, d := range deps {
				for _, bad := range linuxOnly {
					if d == bad || strings.HasPrefix(d, bad+"/") || strings.HasSuffix(bad, "/") && strings.HasPrefix(d, bad) {
						t.Errorf("GOOS=%s: %v depend on %s", goos, portable, d)
					}
				}
			}
		})
	}
}
