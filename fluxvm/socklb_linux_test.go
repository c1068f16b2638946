package fluxvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/internal/cgroup2"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// testCgroup creates a cgroup below the cgroup v2 root for this test
// alone (DESIGN.md §6: the socket hooks are never attached to the root in
// tests) and removes it when the test ends. No process is moved into it.
func testCgroup(t *testing.T, name string) string {
	t.Helper()
	testenv.RequirePrivileged(t)
	root, err := cgroup2.Root()
	if err != nil {
		if testenv.Required() {
			t.Fatalf("socket LB tests need a cgroup v2 hierarchy: %v", err)
		}
		t.Skipf("skipping: socket LB tests need a cgroup v2 hierarchy: %v", err)
	}
	dir := filepath.Join(root, fmt.Sprintf("fluxvm-test-%s-%s", name, testenv.Suffix()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create test cgroup: %v", err)
	}
	t.Cleanup(func() {
		// The links pinned on it are gone with the pin root by now (the
		// pin root's cleanup was registered later, so it ran first); a
		// cgroup with no process and no child can be removed anyway.
		if err := unix.Rmdir(dir); err != nil {
			t.Errorf("remove test cgroup %s: %v", dir, err)
		}
	})
	return dir
}

// cgroupAttachTypes are the attach types of bpf.CgroupHooks, in order.
var cgroupAttachTypes = map[bpf.CgroupHook]ebpf.AttachType{
	bpf.HookConnect4: ebpf.AttachCGroupInet4Connect, bpf.HookConnect6: ebpf.AttachCGroupInet6Connect,
	bpf.HookSendmsg4: ebpf.AttachCGroupUDP4Sendmsg, bpf.HookSendmsg6: ebpf.AttachCGroupUDP6Sendmsg,
	bpf.HookRecvmsg4: ebpf.AttachCGroupUDP4Recvmsg, bpf.HookRecvmsg6: ebpf.AttachCGroupUDP6Recvmsg,
	bpf.HookGetpeername4: ebpf.AttachCgroupInet4GetPeername, bpf.HookGetpeername6: ebpf.AttachCgroupInet6GetPeername,
	bpf.HookSockRelease: ebpf.AttachCgroupInetSockRelease,
}

// cgroupPrograms asks the kernel which programs run on each socket hook of
// the cgroup at path (attached to it directly, not inherited).
func cgroupPrograms(t *testing.T, path string) map[bpf.CgroupHook][]ebpf.ProgramID {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[bpf.CgroupHook][]ebpf.ProgramID{}
	for _, h := range bpf.CgroupHooks {
		r, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: cgroupAttachTypes[h]})
		if err != nil {
			t.Fatalf("query %s on %s: %v", h, path, err)
		}
		for _, p := range r.Programs {
			out[h] = append(out[h], p.ID)
		}
	}
	return out
}

// ourCgroupLinks returns the id of each pinned socket hook link of d on
// the cgroup with id, and the program each runs. The pin names are the
// loader's (links/cgroup_<id>_<hook>, bpf/connect.go): the test reads
// them to prove that a restart keeps the same kernel links.
func ourCgroupLinks(t *testing.T, pinRoot string, id uint64) map[bpf.CgroupHook][2]uint32 {
	t.Helper()
	out := map[bpf.CgroupHook][2]uint32{}
	for _, h := range bpf.CgroupHooks {
		l, err := link.LoadPinnedLink(filepath.Join(pinRoot, "links", fmt.Sprintf("cgroup_%d_%s", id, h)), nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			t.Fatal(err)
		}
		out[h] = [2]uint32{uint32(info.ID), uint32(info.Program)}
	}
	return out
}

func allHookNames() []string {
	var out []string
	for _, h := range bpf.CgroupHooks {
		out = append(out, string(h))
	}
	return out
}

func cgroupInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestSocketLBAttach opens a dataplane with cgroup_connect on cgroups the
// test creates and checks the life of the socket hooks:
//
//   - every hook is attached to the cgroup (the kernel's own list), with
//     links pinned under the pin root, and the status says so;
//   - a restart keeps the same links (same link ids) and points them at
//     its own programs; the status says reused;
//   - a restart on another cgroup_path moves the hooks: the old cgroup has
//     none left;
//   - a cgroup_path that is not a cgroup v2 directory is refused, naming
//     the reason, with nothing attached or changed;
//   - cgroup_connect off removes the hooks an earlier start left;
//   - Cleanup removes them.
func TestSocketLBAttach(t *testing.T) {
	cgA := testCgroup(t, "sock-a")
	cgB := testCgroup(t, "sock-b")
	ns := testenv.NewNetNS(t, "fvsock")
	pinRoot := filepath.Join(testenv.PinRoot(t), "service")
	opts := Options{
		Loader:              bpf.Options{PinRoot: pinRoot, Tier: bpf.TierS},
		ConntrackGCInterval: -1,
		InNamespace:         ns.Do,
		SocketLB:            SocketLBOptions{CgroupConnect: true, CgroupPath: cgA},
	}
	idA, idB := cgroupInode(t, cgA), cgroupInode(t, cgB)

	open := func(o Options) *Dataplane {
		t.Helper()
		d, err := Open(context.Background(), o)
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		return d
	}
	// check verifies that d's hooks are all on cg (and only d's programs)
	// and returns the links.
	check := func(when string, d *Dataplane, cg string, id uint64, reused bool) map[bpf.CgroupHook][2]uint32 {
		t.Helper()
		st := d.Status().SocketLB
		if !st.Enabled || st.CgroupPath != cg || st.CgroupID != id || !slices.Equal(st.Hooks, allHookNames()) || st.Reused != reused {
			t.Errorf("%s: status %+v, want every hook on %s (id %d), reused %v", when, st, cg, id, reused)
		}
		if c := d.Status().Capacities.Sockets; c != 16384 {
			t.Errorf("%s: capacities.sockets %d, want tier S's 16384", when, c)
		}
		as, err := d.dp.CgroupAttachments()
		if err != nil || len(as) != 1 || as[0].ID != id || len(as[0].Hooks) != len(bpf.CgroupHooks) {
			t.Errorf("%s: attachments %+v, %v; want every hook on cgroup %d alone", when, as, err, id)
		}
		links := ourCgroupLinks(t, pinRoot, id)
		progs := cgroupPrograms(t, cg)
		for _, h := range bpf.CgroupHooks {
			l, ok := links[h]
			if !ok {
				t.Errorf("%s: no pinned link for %s", when, h)
				continue
			}
			if got := progs[h]; len(got) != 1 || uint32(got[0]) != l[1] {
				t.Errorf("%s: the kernel runs %v on %s of %s, want our link's program %d", when, got, h, cg, l[1])
			}
		}
		return links
	}

	d := open(opts)
	first := check("first start", d, cgA, idA, false)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	// Closed: the hooks keep serving.
	if progs := cgroupPrograms(t, cgA); len(progs[bpf.HookConnect4]) != 1 {
		t.Errorf("after Close: connect4 of the cgroup runs %v, want our program", progs[bpf.HookConnect4])
	}

	d = open(opts)
	again := check("restart", d, cgA, idA, true)
	for _, h := range bpf.CgroupHooks {
		if again[h][0] != first[h][0] {
			t.Errorf("restart: %s is link %d, was %d: the pinned link was not kept", h, again[h][0], first[h][0])
		}
		if again[h][1] == first[h][1] {
			t.Errorf("restart: %s still runs program %d of the first start", h, first[h][1])
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	// A path that is not a cgroup v2 directory: refused before anything
	// changes; the hooks on cgroup A stay as they were.
	bad := opts
	bad.SocketLB.CgroupPath = t.TempDir()
	if d, err := Open(context.Background(), bad); !errors.Is(err, cgroup2.ErrNotCgroupV2) || !errors.Is(err, bpf.ErrNotCgroupV2) {
		if d != nil {
			d.Close()
		}
		t.Fatalf("open on a tmpfs directory: %v, want ErrNotCgroupV2", err)
	}
	if v1 := cgroupV1Dir(t); v1 != "" {
		bad.SocketLB.CgroupPath = v1
		if d, err := Open(context.Background(), bad); !errors.Is(err, cgroup2.ErrNotCgroupV2) || !strings.Contains(fmt.Sprint(err), "cgroup v1") {
			if d != nil {
				d.Close()
			}
			t.Fatalf("open on cgroup v1 %s: %v, want ErrNotCgroupV2 naming cgroup v1", v1, err)
		}
	}
	if links := ourCgroupLinks(t, pinRoot, idA); len(links) != len(bpf.CgroupHooks) || links[bpf.HookConnect4] != again[bpf.HookConnect4] {
		t.Errorf("after refused opens: links %v, want those of the restart %v", links, again)
	}

	// Another cgroup_path: the hooks move.
	moved := opts
	moved.SocketLB.CgroupPath = cgB
	d = open(moved)
	check("moved to cgroup B", d, cgB, idB, false)
	if progs := cgroupPrograms(t, cgA); len(progs) != 0 {
		t.Errorf("moved: cgroup A still runs %v", progs)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	// cgroup_connect off removes them.
	off := opts
	off.SocketLB.CgroupConnect, off.SocketLB.CgroupPath = false, ""
	d = open(off)
	if st := d.Status().SocketLB; st.Enabled || len(st.Hooks) != 0 || st.CgroupID != 0 || len(st.StaleCgroups) != 0 {
		t.Errorf("cgroup_connect off: status %+v", st)
	}
	if as, err := d.dp.CgroupAttachments(); err != nil || len(as) != 0 {
		t.Errorf("cgroup_connect off: attachments %+v, %v", as, err)
	}
	if progs := cgroupPrograms(t, cgB); len(progs) != 0 {
		t.Errorf("cgroup_connect off: cgroup B still runs %v", progs)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	// Cleanup removes them.
	d = open(opts)
	check("on again", d, cgA, idA, false)
	if err := d.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	if progs := cgroupPrograms(t, cgA); len(progs) != 0 {
		t.Errorf("after Cleanup: cgroup A still runs %v", progs)
	}
	if st := d.Status().SocketLB; len(st.Hooks) != 0 {
		t.Errorf("after Cleanup: status %+v", st)
	}
	if _, err := os.Stat(pinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("after Cleanup: %s: %v", pinRoot, err)
	}
}

// cgroupV1Dir is a cgroup v1 hierarchy's mount point, or "" when the
// machine has none.
func cgroupV1Dir(t *testing.T) string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields := strings.Fields(pre)
		if ok && strings.HasPrefix(post, "cgroup ") && len(fields) > 4 {
			return fields[4]
		}
	}
	return ""
}

// TestSocketLBDestroyAfterBackendChanges: the destroy worker (here the
// datapath's real socket iterator, in the test's namespace, with no timer)
// runs once at Open, not when Ready backends are added, and again after a
// backend is removed and after one is applied Unhealthy; the status counts
// the runs and reports the kernel's support. (Which sockets it destroys is
// the socket tests' concern: here there are none.)
func TestSocketLBDestroyAfterBackendChanges(t *testing.T) {
	cg := testCgroup(t, "sock-d")
	ns := testenv.NewNetNS(t, "fvsockd")
	opts := Options{
		Loader:              bpf.Options{PinRoot: filepath.Join(testenv.PinRoot(t), "service"), Tier: bpf.TierS},
		ConntrackGCInterval: -1,
		InNamespace:         ns.Do,
		SocketLB:            SocketLBOptions{CgroupConnect: true, CgroupPath: cg},
		sockDestroyEvery:    -1,
	}
	d, err := Open(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Cleanup(context.Background()) })
	runs := func() uint64 { return d.Status().SocketLB.Destroy.Runs }
	settle := func(what string, want uint64) {
		t.Helper()
		testenv.Eventually(t, fmt.Sprintf("%s: run %d", what, want), func() bool { return runs() >= want })
		time.Sleep(50 * time.Millisecond)
		if got := runs(); got != want {
			t.Fatalf("%s: %d runs, want %d", what, got, want)
		}
	}
	settle("open", 1)
	if st := d.Status().SocketLB.Destroy; st.Supported == nil || !*st.Supported || st.LastError != "" || st.Destroyed != 0 {
		t.Fatalf("destroy status after the first run on Linux 6.18: %+v", st)
	}

	svc := Service{
		Name:  "dns",
		VIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.53")},
		Ports: []ServicePort{{Port: 53, Protocol: UDP}},
		Backends: []Backend{
			{Address: netip.MustParseAddr("10.1.0.2"), Port: 5353},
			{Address: netip.MustParseAddr("10.1.0.3"), Port: 5353},
		},
	}
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	settle("Ready backends added", 1)

	svc.Backends = svc.Backends[:1]
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	settle("a backend removed", 2)

	svc.Backends[0].State = BackendUnhealthy
	if _, err := d.ApplyService(ctx, svc); err != nil {
		t.Fatal(err)
	}
	settle("a backend Unhealthy", 3)

	if err := d.DeleteService(ctx, "dns"); err != nil {
		t.Fatal(err)
	}
	settle("the service deleted", 4)

	// The health checker turns a Ready backend Unhealthy (nothing
	// answers in the test's empty namespace): another run.
	web := Service{
		Name:        "web",
		VIPs:        []netip.Addr{netip.MustParseAddr("10.96.0.80")},
		Ports:       []ServicePort{{Port: 80, Protocol: TCP}},
		Backends:    []Backend{{Address: netip.MustParseAddr("10.1.0.4"), Port: 8080}},
		HealthCheck: &HealthCheck{Kind: "tcp", TimeoutMs: 200, IntervalMs: 60_000, UnhealthyThreshold: 1, HealthyThreshold: 1},
	}
	if _, err := d.ApplyService(ctx, web); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ReconcileHealth(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, "the health check's Unhealthy to trigger a run", func() bool { return runs() >= 5 })
	if h := d.Health(); len(h.Services) != 1 || len(h.Services[0].Backends) != 1 || h.Services[0].Backends[0].Observed != "unhealthy" {
		t.Errorf("health %+v, want the backend observed unhealthy", h)
	}
}
