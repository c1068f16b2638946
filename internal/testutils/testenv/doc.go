// Package testenv is the test support every privileged FluxVM test uses:
// privilege gating, throwaway network namespaces, per-test pin roots and
// the cgroup v2 root (throwaway cgroups and processes in them: cgtest).
//
// Privileged tests call RequirePrivileged first. Without the capabilities
// they skip with the reason; with FLUXVM_REQUIRE_PRIVILEGED=1 in the
// environment (CI sets it) they fail instead, so a CI run can never pass by
// skipping everything.
//
// Everything a helper creates is removed by t.Cleanup, also when the test
// fails, and carries a per-run suffix so parallel runs never collide.
package testenv
