package bpf

import (
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// The kernel's limits that the budgets below must stay far from.
const (
	kernelInsnLimit  = 1_000_000 // BPF_COMPLEXITY_LIMIT_INSNS: processed instructions per load
	kernelStackLimit = 512       // MAX_BPF_STACK: the deepest call chain's combined frames
	// stackCeiling is the most a stack budget may be: 64 bytes of the
	// kernel's 512 stay free for the next feature (issue 34).
	stackCeiling = 448
)

// verifierBudget is what one program may cost the verifier.
type verifierBudget struct {
	insns uint32 // processed instructions (ProgramInfo.VerifiedInstructions)
	stack int    // combined stack of the deepest call chain, bytes
}

// verifierBudgets holds every program of every object, the same for each
// map tier (the tiers differ only in capacities, and the verifier's cost
// does not depend on them; the test checks all three anyway).
//
// Headroom rules:
//   - insns is set 15-25% above the figure measured when the budget was
//     last changed (programs have grown since: see the figures beside each
//     budget), and must stay below a tenth of the kernel's 1M limit:
//     a feature that needs more belongs in a global function or behind a
//     compile-time gate (docs/architecture.md, "Adding a feature to the
//     datapath").
//   - stack is set about 15% above the measured deepest chain, capped at
//     448 bytes (issue 34: 64 of the kernel's 512 kept free). A program
//     at its budget has no headroom left (fluxvm_from_vm and
//     fluxvm_xdp_ns at 448): new state goes to per-CPU scratch
//     (lib/maps.h), not the stack.
//   - Raise a budget only deliberately, in the commit that needs it, with
//     the new measured figure and the reason in the comment beside it.
//
// Measured on 2026-12-07 (kernel 6.18, clang 14), all tiers alike: the
// figures beside each budget (`go test -v -run TestVerifierBudget ./bpf/`).
// Issue 34 set the TC and XDP budgets to 80% of the budgets before it
// (fluxvm_to_vm 45,000 -> 36,000, fluxvm_from_vm 89,000 -> 71,200,
// fluxvm_ns_in 81,000 -> 64,800, fluxvm_ns_out 34,000 -> 27,200,
// fluxvm_xdp_ns 57,000 -> 45,600) and their stack to at most 448 bytes,
// with every feature compiled in. What made the room: the IPv6
// extension-header walk passes its offset through per-CPU scratch, which
// the verifier does not track (one state per header instead of one per
// path so far; XDP reads it back from its parse result, in scratch); the IPv6 reply paths keep their
// reverse-NAT key in scratch (fluxvm_scratch_tuple6, 32 bytes off
// fluxvm_to_vm's reply6_stored chain); fluxvm_flow_open's frame is 32
// bytes (it reads its seq and clock back from scratch instead of
// spilling them), which leaves the IPv6 NAT forward's conntrack key room
// on fluxvm_forward6_nat's frame within 448 bytes (in scratch it cost
// the IPv6 conntrack hit 1-2%); and the XDP program keeps its parse result in
// scratch (fluxvm_pkt_new, 48 bytes off its first frame). The TC
// programs keep theirs on the stack: through a scratch pointer their
// IPv4 hot paths measured 3-9% slower (docs/benchmarks.md, issue 34).
// Before: from_vm 80,901 / 480 bytes, to_vm 44,966 / 480, ns_in 74,804 /
// 448, ns_out 32,020 / 352, xdp_ns 49,136 / 512.
// The history below is of 2026-12-01.
// fluxvm_from_vm grew when the forward path was split by mode (the DSR
// paths, global functions verified on their own, ~7,100 insns for both
// families; its inline IPv4 path did not grow) and when east-west replies
// became derived (issue 16: the east-west new-flow path learns one entry,
// or both for a frontend with SvcFlagRevStored, and forgets a superseded
// stored half). fluxvm_to_vm has the derived reply path (a loop over the
// fluxvm_be2fe slots, unrolled) and the stored reply path (a global
// function); the ICMP paths keep their stage state in per-CPU scratch,
// which took every chain's stack down by 40-60 bytes.
var verifierBudgets = map[string]map[string]verifierBudget{
	"fluxvm_service": {
		// Stack budgets: about 15% above the measured chain.
		// Raised for issue 21's L7 enforce: its stage is a global
		// function (~4,500 insns, verified in each program that calls
		// it); the bypass is decided inside fluxvm_policy_decide, so the
		// inline IPv4 path is verified once (a flags change ahead of it
		// cost 8,000 more).
		// Issue 34: the parse result on the stack (faster hot paths
		// than through a pointer into scratch), the IPv6 extension
		// walk's offset and the IPv6 reply's key in scratch; the IPv6
		// NAT forward's key on the stack (fluxvm_flow_open's frame 32).
		"fluxvm_from_vm": {insns: 71_200, stack: 448}, // 69068 insns (was 80901); 448 bytes (forward6_nat(216) -> policy_decide/flow_open(32) chain; was 480)
		"fluxvm_to_vm":   {insns: 36_000, stack: 448}, // 33589 insns (was 44966); 416 bytes (icmp6_ew chain; was 480)
		"fluxvm_ns_in":   {insns: 64_800, stack: 448}, // 64251 insns (was 74804); 384 bytes (forward6_snat -> policy_decide chain; was 448)
		"fluxvm_ns_out":  {insns: 27_200, stack: 352}, // 21178 insns (was 32020); 320 bytes (icmp6_snat chain; was 352)
	},
	// The north-south XDP object (issue 17): its one program, with the
	// IPv6 SNAT and the DSR paths as global functions.
	"fluxvm_service_xdp": {
		// Raised from 46,000 for issue 20: flow records open inline in XDP
		// (its IPv6 SNAT chain has no frame to spare for a global
		// function: 224 + 256 + 32 = 512 bytes), 38,106 -> 49,990 insns.
		// Stack raised to the kernel's 512 for issue 22: a new flow while
		// HA replication is on is left to TC (one more branch in the
		// inline IPv4 SNAT path, +8 bytes of its frame, which rounds the
		// IPv6 SNAT chain from 480 to 512). Nothing more fits on this
		// chain: new XDP state goes to per-CPU scratch.
		// Issue 34: 80% of 57,000 and 448 bytes (the parse result in
		// per-CPU scratch took 48 bytes off the program's frame).
		"fluxvm_xdp_ns": {insns: 45_600, stack: 448}, // 38093 insns (was 49136); 448 bytes (xdp_snat6 chain; was 512)
	},
	// Socket load balancing (issue 18): one program per cgroup hook, each
	// small (no packet to parse); the IPv6 ones read and write the
	// address a word at a time. And the iterator that terminates
	// connected UDP sockets of a backend gone. (The forward path has two
	// ways, TCP and UDP: a TCP socket keeps no association.)
	"fluxvm_service_connect": {
		"fluxvm_sock_connect4":     {insns: 1_150, stack: 192}, // 872 insns; 160 bytes
		"fluxvm_sock_connect6":     {insns: 2_200, stack: 256}, // 1812 insns; 224 bytes
		"fluxvm_sock_sendmsg4":     {insns: 1_150, stack: 192}, // 872 insns; 160 bytes
		"fluxvm_sock_sendmsg6":     {insns: 2_200, stack: 256}, // 1812 insns; 224 bytes
		"fluxvm_sock_recvmsg4":     {insns: 150, stack: 128},   // 123 insns; 96 bytes
		"fluxvm_sock_recvmsg6":     {insns: 400, stack: 160},   // 329 insns; 128 bytes
		"fluxvm_sock_getpeername4": {insns: 150, stack: 128},   // 123 insns; 96 bytes
		"fluxvm_sock_getpeername6": {insns: 400, stack: 160},   // 329 insns; 128 bytes
		"fluxvm_sock_release":      {insns: 250, stack: 96},    // 186 insns; 64 bytes
	},
	"fluxvm_sock_destroy": {
		"fluxvm_sock_destroy_udp": {insns: 460, stack: 128}, // 366 insns; 96 bytes
	},
}

// verifierObjects are the objects whose programs the budget covers: every
// attach point's object in every tier. A new object (XDP, cgroup connect)
// is added here and to verifierBudgets.
var verifierObjects = []struct {
	object string
	tier   Tier
	spec   func() (*ebpf.CollectionSpec, error)
}{
	{"fluxvm_service", TierS, loadServiceTierS},
	{"fluxvm_service", TierM, loadService},
	{"fluxvm_service", TierL, loadServiceTierL},
	{"fluxvm_service_xdp", TierS, loadServiceXdpTierS},
	{"fluxvm_service_xdp", TierM, loadServiceXdp},
	{"fluxvm_service_xdp", TierL, loadServiceXdpTierL},
	{"fluxvm_service_connect", TierS, loadServiceConnectTierS},
	{"fluxvm_service_connect", TierM, loadServiceConnect},
	{"fluxvm_service_connect", TierL, loadServiceConnectTierL},
	{"fluxvm_sock_destroy", TierM, loadSockDestroy},
}

// verifierCost is what the verifier reported for one program.
type verifierCost struct {
	insns  uint32 // processed instructions
	frames []int  // stack depth per subprogram, in the kernel's order
	chain  []string
	stack  int // combined stack of the deepest call chain
}

// TestVerifierBudget loads every program of every object and tier and
// checks the verifier's cost against verifierBudgets, so that no feature
// can quietly push a program toward the kernel's limits. It prints a table
// of actual figures, budgets and kernel limits (go test -v).
func TestVerifierBudget(t *testing.T) {
	testenv.RequirePrivileged(t)

	var rows []string
	seen := map[string]map[string]bool{}
	for _, o := range verifierObjects {
		costs := measureVerifier(t, o.spec)
		budgets := verifierBudgets[o.object]
		if seen[o.object] == nil {
			seen[o.object] = map[string]bool{}
		}
		for _, prog := range slices.Sorted(maps.Keys(costs)) {
			c := costs[prog]
			seen[o.object][prog] = true
			b, ok := budgets[prog]
			if !ok {
				t.Errorf("%s (tier %s): program %s has no verifier budget: add it to verifierBudgets "+
					"(measured %d insns, stack %d bytes via %s), about 20%% above these figures",
					o.object, o.tier, prog, c.insns, c.stack, strings.Join(c.chain, " -> "))
				continue
			}
			rows = append(rows, fmt.Sprintf("%-15s %-4s %-16s %8d %8d %5.1f%% %9d   %4d %4d %4d   %s",
				o.object, o.tier, prog, c.insns, b.insns, 100*float64(c.insns)/float64(b.insns), kernelInsnLimit,
				c.stack, b.stack, kernelStackLimit, strings.Join(c.chain, " -> ")))
			if msg := checkBudget(c, b); msg != "" {
				t.Errorf("%s (tier %s) %s: %s", o.object, o.tier, prog, msg)
			}
		}
	}
	for obj, budgets := range verifierBudgets {
		for prog, b := range budgets {
			if b.insns > kernelInsnLimit/10 || b.stack > stackCeiling {
				t.Errorf("verifierBudgets %s/%s = %d insns, %d bytes: a budget stays below a tenth of the kernel's "+
					"%d instructions and at most %d of its %d bytes of stack", obj, prog, b.insns, b.stack, kernelInsnLimit,
					stackCeiling, kernelStackLimit)
			}
			if !seen[obj][prog] {
				t.Errorf("verifierBudgets has %s/%s, which no object loads: remove the stale entry", obj, prog)
			}
		}
	}
	t.Logf("verifier cost per program (insns = processed instructions; stack = deepest call chain, bytes)\n"+
		"%-15s %-4s %-16s %8s %8s %6s %9s   %4s %4s %4s   %s\n%s",
		"object", "tier", "program", "insns", "budget", "used", "kernel", "stk", "bdgt", "krnl", "deepest chain",
		strings.Join(rows, "\n"))
}

// checkBudget says how c exceeds b and what to do about it, or "".
func checkBudget(c verifierCost, b verifierBudget) string {
	var over []string
	if c.insns > b.insns {
		over = append(over, fmt.Sprintf("the verifier processed %d instructions, over the budget of %d (kernel limit %d)",
			c.insns, b.insns, kernelInsnLimit))
	}
	if c.stack > b.stack {
		over = append(over, fmt.Sprintf("the deepest call chain %s uses %d bytes of stack (frames %v), over the budget of %d (kernel limit %d)",
			strings.Join(c.chain, " -> "), c.stack, c.frames, b.stack, kernelStackLimit))
	}
	if len(over) == 0 {
		return ""
	}
	return strings.Join(over, "; ") + ".\n\tThe hot path grew. Either keep it from growing: move the new code into a global " +
		"(noinline) function the verifier checks once on its own, put it behind a compile-time gate (#if) so only the " +
		"objects that need it carry it, or keep large state in per-CPU scratch instead of on the stack " +
		"(docs/architecture.md, \"Adding a feature to the datapath\"); or raise the budget in verifierBudgets " +
		"(bpf/verifier_test.go) deliberately, in the same commit, with the new figure and the reason."
}

var (
	processedRE  = regexp.MustCompile(`processed (\d+) insns`)
	stackDepthRE = regexp.MustCompile(`stack depth ([0-9+]+)`)
)

// measureVerifier loads every program of the object with the verifier's
// statistics and returns each one's cost. One load per object serves all
// its programs.
func measureVerifier(t *testing.T, load func() (*ebpf.CollectionSpec, error)) map[string]verifierCost {
	t.Helper()
	spec, err := load()
	if err != nil {
		t.Fatal(err)
	}
	// The lifecycle maps preallocate up to a million entries each; the
	// verifier's cost does not depend on a hash map's capacity (array
	// capacities, which it can depend on, stay as built).
	for _, m := range spec.Maps {
		if (m.Type == ebpf.Hash || m.Type == ebpf.LRUHash) && m.MaxEntries > 4096 {
			m.MaxEntries = 4096
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		Programs: ebpf.ProgramOptions{LogLevel: ebpf.LogLevelStats},
	})
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	defer coll.Close()

	costs := make(map[string]verifierCost, len(coll.Programs))
	for name, prog := range coll.Programs {
		c, err := verifierCostOf(spec.Programs[name], prog)
		if err != nil {
			t.Fatalf("%s: %v\nverifier log:\n%s", name, err, prog.VerifierLog)
		}
		costs[name] = c
	}
	return costs
}

// verifierCostOf reads the processed instructions from the program's info
// (checked against the log) and computes the deepest call chain's stack
// from the per-subprogram depths in the log and the calls in the program.
func verifierCostOf(ps *ebpf.ProgramSpec, prog *ebpf.Program) (verifierCost, error) {
	var c verifierCost
	info, err := prog.Info()
	if err != nil {
		return c, err
	}
	n, ok := info.VerifiedInstructions()
	if !ok {
		return c, fmt.Errorf("the kernel reports no verified instruction count")
	}
	c.insns = n
	m := processedRE.FindStringSubmatch(prog.VerifierLog)
	if m == nil {
		return c, fmt.Errorf("no \"processed N insns\" in the verifier log")
	}
	if logged, _ := strconv.ParseUint(m[1], 10, 32); uint32(logged) != n {
		return c, fmt.Errorf("verifier log says %s insns, program info %d", m[1], n)
	}
	m = stackDepthRE.FindStringSubmatch(prog.VerifierLog)
	if m == nil {
		return c, fmt.Errorf("no \"stack depth\" in the verifier log")
	}
	for _, s := range strings.Split(m[1], "+") {
		d, err := strconv.Atoi(s)
		if err != nil {
			return c, fmt.Errorf("stack depth %q: %v", m[1], err)
		}
		c.frames = append(c.frames, d)
	}

	// The log lists the subprograms' depths in the kernel's order, which
	// the program's function info gives with names.
	funcs, err := info.FuncInfos()
	if err != nil {
		return c, err
	}
	if len(funcs) != len(c.frames) {
		return c, fmt.Errorf("%d functions but %d stack depths in the log", len(funcs), len(c.frames))
	}
	depth := map[string]int{}
	for i, f := range funcs {
		depth[f.Func.Name] = c.frames[i]
	}
	c.stack, c.chain = deepestChain(ps.Name, callGraph(ps), depth, map[string]bool{})
	return c, nil
}

// callGraph maps each function of the program to the functions it calls.
func callGraph(ps *ebpf.ProgramSpec) map[string][]string {
	calls := map[string][]string{}
	fn := ps.Name
	for _, ins := range ps.Instructions {
		if sym := ins.Symbol(); sym != "" {
			fn = sym
		}
		if ins.IsFunctionCall() && ins.Reference() != "" && !slices.Contains(calls[fn], ins.Reference()) {
			calls[fn] = append(calls[fn], ins.Reference())
		}
	}
	return calls
}

// deepestChain returns the largest combined stack of a call chain from fn,
// each frame rounded up to 32 bytes as the kernel does when it checks the
// chain against MAX_BPF_STACK (16 under the JIT; 32 is the stricter one).
func deepestChain(fn string, calls map[string][]string, depth map[string]int, onPath map[string]bool) (int, []string) {
	if onPath[fn] {
		return 0, nil // the kernel rejects recursion anyway
	}
	onPath[fn] = true
	defer delete(onPath, fn)
	best, bestChain := 0, []string(nil)
	for _, callee := range calls[fn] {
		if d, ch := deepestChain(callee, calls, depth, onPath); d > best {
			best, bestChain = d, ch
		}
	}
	own := (max(depth[fn], 1) + 31) / 32 * 32
	return own + best, append([]string{fmt.Sprintf("%s(%d)", fn, depth[fn])}, bestChain...)
}

func TestDeepestChain(t *testing.T) {
	calls := map[string][]string{"main": {"a", "b"}, "a": {"c"}, "b": {"c"}}
	depth := map[string]int{"main": 100, "a": 8, "b": 200, "c": 40}
	got, chain := deepestChain("main", calls, depth, map[string]bool{})
	// 128 + 224 + 64: frames rounded up to 32 bytes, through the larger b.
	if got != 416 || strings.Join(chain, " ") != "main(100) b(200) c(40)" {
		t.Errorf("deepestChain = %d via %v, want 416 via main b c", got, chain)
	}
	if msg := checkBudget(verifierCost{insns: 10, stack: got, chain: chain}, verifierBudget{insns: 10, stack: 400}); !strings.Contains(msg, "416 bytes") {
		t.Errorf("checkBudget over the stack budget = %q", msg)
	}
	if msg := checkBudget(verifierCost{insns: 11, stack: 1}, verifierBudget{insns: 10, stack: 400}); !strings.Contains(msg, "11 instructions") {
		t.Errorf("checkBudget over the instruction budget = %q", msg)
	}
	if msg := checkBudget(verifierCost{insns: 10, stack: 400}, verifierBudget{insns: 10, stack: 400}); msg != "" {
		t.Errorf("checkBudget at the budget = %q, want none", msg)
	}
}
