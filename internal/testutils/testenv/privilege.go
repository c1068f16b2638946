package testenv

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
)

// RequireEnv names the environment variable that turns a privilege skip
// into a failure.
const RequireEnv = "FLUXVM_REQUIRE_PRIVILEGED"

// Capability bits as numbered by the kernel (linux/capability.h).
const (
	capNetAdmin = 12
	capSysAdmin = 21
	capBPF      = 39
)

var probe = sync.OnceValue(privilegeProblem)

// RequirePrivileged stops the test unless the process may load BPF
// programs and manage network namespaces and links. It skips with the
// reason, or fails when FLUXVM_REQUIRE_PRIVILEGED=1.
func RequirePrivileged(tb testing.TB) {
	tb.Helper()
	gate(tb, probe())
}

func gate(tb testing.TB, problem string) {
	tb.Helper()
	if problem == "" {
		return
	}
	if Required() {
		tb.Fatalf("privileged test cannot run: %s (%s=1 is set, so this fails instead of skipping)", problem, RequireEnv)
		return
	}
	tb.Skipf("skipping privileged test: %s (run as root, or set %s=1 to make this a failure)", problem, RequireEnv)
}

// Required reports whether privileged tests must run rather than skip.
func Required() bool {
	return os.Getenv(RequireEnv) == "1"
}

// privilegeProblem returns "" when the process can do what privileged tests
// need, or a sentence saying what is missing.
func privilegeProblem() string {
	eff, err := effectiveCaps()
	if err != nil {
		return err.Error()
	}
	var missing []string
	if eff&(1<<capNetAdmin) == 0 {
		missing = append(missing, "CAP_NET_ADMIN")
	}
	if eff&(1<<capBPF) == 0 && eff&(1<<capSysAdmin) == 0 {
		missing = append(missing, "CAP_BPF")
	}
	if eff&(1<<capSysAdmin) == 0 {
		// Creating network namespaces and mounting bpffs need it.
		missing = append(missing, "CAP_SYS_ADMIN")
	}
	if len(missing) > 0 {
		return "process lacks " + strings.Join(missing, ", ")
	}
	// Capabilities can be present while BPF is still refused (LSMs,
	// sysctls, seccomp); a real map creation tells.
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		return fmt.Sprintf("cannot create a BPF map: %v", err)
	}
	m.Close()
	return ""
}

func effectiveCaps() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, fmt.Errorf("cannot read capabilities: %w", err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	return 0, fmt.Errorf("cannot read capabilities: no CapEff in /proc/self/status")
}
