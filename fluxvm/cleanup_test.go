package fluxvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/internal/testutils/testenv"
)

// TestOpenPinRootInUse: a second Open on the pin root of an open
// Dataplane (here in the same process; TestCleanupWhileRunning in
// cmd/fluxvmd is another process) fails with ErrInUse naming the holder,
// and changes nothing: the first dataplane keeps its service and its VIP
// keeps answering. (It used to succeed, see no services, hand out
// service id 1 again and break the first dataplane's VIP.) A failed Open
// and Close let the pin root go.
func TestOpenPinRootInUse(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	ctx := context.Background()
	if _, err := d.ApplyService(ctx, e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	echo(t, e.dial(t, vip4), "before the second open")

	d2, err := Open(context.Background(), e.opts)
	if err == nil {
		d2.Close()
		t.Fatal("a second Open on the pin root of an open dataplane succeeded")
	}
	if !errors.Is(err, ErrInUse) || !errors.Is(err, bpf.ErrInUse) || !strings.Contains(err.Error(), fmt.Sprintf("this process (pid %d)", os.Getpid())) {
		t.Errorf("second Open: %v; want ErrInUse naming this process", err)
	}
	// Nor does Cleanup go ahead.
	if err := Cleanup(context.Background(), CleanupOptions{PinRoot: e.opts.Loader.PinRoot, CatalogPath: e.opts.CatalogPath, InNamespace: e.lab.Node.Do}); !errors.Is(err, ErrInUse) {
		t.Errorf("Cleanup while a dataplane is open: %v, want ErrInUse", err)
	}
	if files, err := catalog.JournalFiles(e.opts.CatalogPath); err != nil || len(files) == 0 {
		t.Errorf("catalog journal after the refused Cleanup: %v, %v", files, err)
	}
	if _, err := os.Stat(filepath.Join(e.opts.Loader.PinRoot, "maps", "fluxvm_meta")); err != nil {
		t.Errorf("pins after the refused Cleanup: %v", err)
	}
	echo(t, e.dial(t, vip4), "after the second open and the refused cleanup")
	if ss := d.Services(); len(ss) != 1 {
		t.Errorf("services of the first dataplane: %+v", ss)
	}

	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	// An Open that fails after taking the pin root lets it go.
	bad := e.opts
	bad.VMEdgeInterfaces = append(slices.Clone(e.opts.VMEdgeInterfaces), VMEdgeInterface{Name: "fvnosuch0", VMID: "ghost"})
	if d2, err := Open(context.Background(), bad); err == nil {
		d2.Close()
		t.Fatal("Open with an interface that does not exist succeeded")
	} else if errors.Is(err, ErrInUse) {
		t.Fatalf("Open after Close: %v", err)
	}
	d2 = e.open(t)
	if ss := d2.Services(); len(ss) != 1 {
		t.Errorf("services after reopening: %+v", ss)
	}
	echo(t, e.dial(t, vip4), "after reopening")
}

// TestCleanupStandalone: after Close, Dataplane.Cleanup and the
// package-level Cleanup (no dataplane running) remove everything: the
// attachments (both attach modes; cls_bpf used to fail "not attached"),
// the pin root and the parent of it that Open created, the catalog, the HA
// lease file next to it, and they publish an empty advertisement
// snapshot; the VIP no longer answers. A second Cleanup finds nothing and
// succeeds. (Dataplane.Cleanup after Close failed with ErrClosed, and
// there was no package-level Cleanup; Cleanup left the parent.)
func TestCleanupStandalone(t *testing.T) {
	for _, mode := range []bpf.AttachMode{bpf.AttachTCX, bpf.AttachClsBPF} {
		for _, how := range []string{"Dataplane.Cleanup", "Cleanup"} {
			t.Run(string(mode)+"/"+how, func(t *testing.T) {
				e := newEnv(t)
				parent := filepath.Join(filepath.Dir(e.opts.Loader.PinRoot), "fluxvm")
				e.opts.Loader.PinRoot = filepath.Join(parent, "service")
				e.opts.Loader.AttachMode = mode
				e.opts.AdvertisementsPath = filepath.Join(t.TempDir(), "adv.json")
				d := e.open(t)
				ctx := context.Background()
				svc := e.service(1, 1, 1)
				svc.Advertise = false
				if _, err := d.ApplyService(ctx, svc); err != nil {
					t.Fatal(err)
				}
				echo(t, e.dial(t, vip4), "before cleanup")
				lease := e.opts.CatalogPath + LeaseFileSuffix
				if err := os.WriteFile(lease, []byte(`{"epoch":3,"superseded_by":4}`), 0o600); err != nil {
					t.Fatal(err)
				}
				if err := d.Close(); err != nil {
					t.Fatal(err)
				}
				gen := readAdvert(t, e.opts.AdvertisementsPath).Generation
				cleanup := func() error {
					if how == "Cleanup" {
						return Cleanup(context.Background(), CleanupOptions{PinRoot: e.opts.Loader.PinRoot, CatalogPath: e.opts.CatalogPath,
							AdvertisementsPath: e.opts.AdvertisementsPath, InNamespace: e.lab.Node.Do})
					}
					return d.Cleanup(context.Background())
				}
				if err := cleanup(); err != nil {
					t.Fatalf("%s after Close: %v", how, err)
				}
				for _, p := range []string{e.opts.Loader.PinRoot, parent, e.opts.CatalogPath, lease} {
					if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
						t.Errorf("%s left after cleanup: %v", p, err)
					}
				}
				if _, err := os.Stat(filepath.Dir(parent)); err != nil {
					t.Errorf("the directory that held the pin root's parent before Open: %v", err)
				}
				assertNothingLeft(t, e)
				if s := readAdvert(t, e.opts.AdvertisementsPath); len(s.Entries) != 0 || s.Generation < gen {
					t.Errorf("advertisements after cleanup: generation %d (before %d), %d entries", s.Generation, gen, len(s.Entries))
				}
				if c, err := e.cli.DialTCP(netip.AddrPortFrom(vip4, 80), 300*time.Millisecond); err == nil {
					c.Close()
					t.Error("the VIP still answers after cleanup")
				}
				if err := cleanup(); err != nil {
					t.Errorf("second %s: %v", how, err)
				}
				// The node starts afresh.
				d2 := e.open(t)
				if ss := d2.Services(); len(ss) != 0 {
					t.Errorf("services after cleanup and Open: %+v", ss)
				}
			})
		}
	}
}

// TestCleanupBadOptions: paths that are not absolute are refused before
// anything is removed.
func TestCleanupBadOptions(t *testing.T) {
	for _, o := range []CleanupOptions{
		{PinRoot: "relative/service"},
		{PinRoot: "/sys/fs/bpf"},
		{PinRoot: "/sys/fs/bpf/x", CatalogPath: "catalog.json"},
		{PinRoot: "/sys/fs/bpf/x", AdvertisementsPath: "adv.json"},
	} {
		err := Cleanup(context.Background(), o)
		if !errors.Is(err, ErrInvalid) && !errors.Is(err, bpf.ErrPinRoot) {
			t.Errorf("Cleanup(%+v): %v, want ErrInvalid or bpf.ErrPinRoot", o, err)
		}
	}
}

// TestParseCleanupConfig: only the keys that say where state lives are
// read; the rest of the table, valid or not, is ignored.
func TestParseCleanupConfig(t *testing.T) {
	o, err := ParseCleanupConfig([]byte(`[sandbox.dataplane.service]
pin_root = "/sys/fs/bpf/node/service"
catalog_path = "/var/lib/node/catalog.json"
node_name = "n1"
ha_epoch = 1
map_tier = "XL"
no_such_key = [1, 2]
[sandbox.dataplane.service.api]
listen = 7
`))
	if err != nil {
		t.Fatal(err)
	}
	want := CleanupOptions{PinRoot: "/sys/fs/bpf/node/service", CatalogPath: "/var/lib/node/catalog.json", AdvertisementsPath: advert.DefaultPath, NodeName: "n1"}
	if o.PinRoot != want.PinRoot || o.CatalogPath != want.CatalogPath || o.AdvertisementsPath != want.AdvertisementsPath || o.NodeName != want.NodeName {
		t.Errorf("got %+v, want %+v", o, want)
	}
	if o, err := ParseCleanupConfig(nil); err != nil || o.PinRoot != bpf.DefaultPinRoot || o.CatalogPath != DefaultCatalogPath {
		t.Errorf("empty document: %+v, %v; want the defaults", o, err)
	}
	for _, doc := range []string{
		"[sandbox.dataplane.service]\npin_root = \"service\"\n",
		"[sandbox.dataplane.service]\ncatalog_path = 3\n",
		"[sandbox.dataplane.service\n",
	} {
		if _, err := ParseCleanupConfig([]byte(doc)); err == nil {
			t.Errorf("%q accepted", doc)
		}
	}
	var ve *ValidationError
	if _, err := ParseCleanupConfig([]byte("[sandbox.dataplane.service]\npin_root = \"service\"\n")); !errors.As(err, &ve) || ve.Field != ConfigTable+".pin_root" {
		t.Errorf("relative pin_root: %v, want a ValidationError naming the key", err)
	}
}

// assertNothingLeft fails when an attachment or qdisc of FluxVM is left
// in the env's node namespace.
func assertNothingLeft(t *testing.T, e *env) {
	t.Helper()
	var left []string
	err := e.lab.Node.Do(func() (err error) {
		left, err = testenv.FluxVMLeftovers()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range left {
		t.Errorf("left after cleanup: %s", l)
	}
}

func readAdvert(t *testing.T, path string) advert.Snapshot {
	t.Helper()
	s, err := advert.Read(path)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestFailedOpenLeavesNoPinRoot: an Open that fails after taking the pin
// root (here: no object in ObjectDir) removes the pin root and the parent
// it created for it, and lets it go; one that fails validation first
// creates nothing.
func TestFailedOpenLeavesNoPinRoot(t *testing.T) {
	parent := filepath.Join(testenv.PinRoot(t), "fluxvm")
	root := filepath.Join(parent, "service")
	opts := Options{Loader: bpf.Options{PinRoot: root, Tier: bpf.TierS, ObjectDir: t.TempDir()}, ConntrackGCInterval: -1}
	if d, err := Open(context.Background(), opts); err == nil {
		d.Close()
		t.Fatal("Open without an object succeeded")
	}
	if _, err := os.Stat(parent); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the failed Open left %s: %v", parent, err)
	}
	opts.Loader.ObjectDir = ""
	opts.Pressure.SoftPercent = 101
	if _, err := Open(context.Background(), opts); !errors.Is(err, ErrInvalid) {
		t.Errorf("Open with pressure_soft_percent 101: %v, want ErrInvalid", err)
	}
	if _, err := os.Stat(parent); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the invalid Open left %s: %v", parent, err)
	}
	// Nothing holds the pin root: an Open with good options goes ahead.
	opts.Pressure.SoftPercent = 0
	d, err := Open(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	d.Close()
}

// ExampleParseCleanupConfig reads where a node's state lives from a
// configuration that ParseConfig refuses (HA without its north-south
// edge): what fluxvmd cleanup does before fluxvm.Cleanup.
func ExampleParseCleanupConfig() {
	doc := []byte(`
[sandbox.dataplane.service]
pin_root = "/sys/fs/bpf/node-a/service"
catalog_path = "/var/lib/fluxvm/node-a.json"
ha_epoch = 3
`)
	_, err := ParseConfig(doc)
	fmt.Println(err != nil)
	o, err := ParseCleanupConfig(doc)
	if err != nil {
		panic(err)
	}
	fmt.Println(o.PinRoot, o.CatalogPath, o.CatalogPath+LeaseFileSuffix)
	// A real cleanup: err = Cleanup(o); errors.Is(err, ErrInUse) while a
	// dataplane holds the pin root.
	// Output:
	// true
	// /sys/fs/bpf/node-a/service /var/lib/fluxvm/node-a.json /var/lib/fluxvm/node-a.json.ha-lease
}

// runChild runs the test binary as a child (main_test.go) doing job
// under `ip netns exec netns`, and returns its output.
func runChild(t *testing.T, netns string, job childJob) string {
	t.Helper()
	b, err := json.Marshal(job)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", netns, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(b))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child %s under ip netns exec %s: %v\n%s", job.Do, netns, err, out)
	}
	return string(out)
}

// TestCleanupUnderIPNetnsExec: Cleanup run under `ip netns exec` in the
// node's namespace (a private /sys: the node's bpffs hidden) while a
// Dataplane holds the pin root fails with ErrPinRoot and the advice to
// run under `nsenter --net`, and changes nothing: the catalog and its
// journal, the HA lease file, the advertisement snapshot, the pins, the
// cls_bpf filters (the VIP keeps answering) and the lock file stay. It
// used to see no pin root, take no lock, and remove all but the pins,
// publishing an empty snapshot and reporting success.
func TestCleanupUnderIPNetnsExec(t *testing.T) {
	e := newEnv(t)
	e.opts.Loader.AttachMode = bpf.AttachClsBPF
	e.opts.AdvertisementsPath = filepath.Join(t.TempDir(), "adv.json")
	d := e.open(t)
	if _, err := d.ApplyService(context.Background(), e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	echo(t, e.dial(t, vip4), "before the cleanup")
	lease := e.opts.CatalogPath + LeaseFileSuffix
	if err := os.WriteFile(lease, []byte(`{"epoch":3}`), 0o600); err != nil {
		t.Fatal(err)
	}
	files := func() map[string]string {
		out := map[string]string{}
		for _, dir := range []string{filepath.Dir(e.opts.CatalogPath), filepath.Dir(e.opts.AdvertisementsPath)} {
			ents, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			for _, en := range ents {
				p := filepath.Join(dir, en.Name())
				b, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				out[p] = string(b)
			}
		}
		return out
	}
	before := files()
	if len(before) < 3 {
		t.Fatalf("files before the cleanup: %v; want at least the catalog journal, the lease and the advertisements", slices.Collect(maps.Keys(before)))
	}
	advice := "nsenter --net=/run/netns/" + e.lab.Node.Name
	// With the catalog (whose lock file is held too) and without it
	// (the pin root's visibility alone stops it).
	for _, catalog := range []string{e.opts.CatalogPath, ""} {
		out := runChild(t, e.lab.Node.Name, childJob{Do: "cleanup", PinRoot: e.opts.Loader.PinRoot, CatalogPath: catalog, Advertisements: e.opts.AdvertisementsPath})
		if !strings.Contains(out, "pin root") || !strings.Contains(out, "ip netns exec") || !strings.Contains(out, advice) {
			t.Errorf("cleanup (catalog %q) under ip netns exec said %q; want a refusal with the advice %q", catalog, out, advice)
		}
		if after := files(); !maps.Equal(before, after) {
			t.Errorf("files changed by the refused cleanup (catalog %q):\nbefore %v\nafter  %v", catalog, slices.Sorted(maps.Keys(before)), slices.Sorted(maps.Keys(after)))
		}
		if _, err := os.Stat(filepath.Join(e.opts.Loader.PinRoot, "maps", "fluxvm_meta")); err != nil {
			t.Errorf("pins after the refused cleanup: %v", err)
		}
		echo(t, e.dial(t, vip4), "after the refused cleanup")
	}
	if ss := d.Services(); len(ss) != 1 {
		t.Errorf("services after the refused cleanups: %+v", ss)
	}
}

// TestCleanupCatalogInUse: the catalog of an open Dataplane is held
// (its lock file, CatalogPath + CatalogLockSuffix): a Cleanup that names
// it with a pin root of its own (which it can hold: the pin root's lock
// cannot tell) fails with ErrInUse naming this process and changes
// nothing, nor can an Open of it on another pin root. It used to
// remove the running dataplane's catalog, journal and lease file. After
// Close, Cleanup removes the lock file with the rest.
func TestCleanupCatalogInUse(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	if _, err := d.ApplyService(context.Background(), e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	lease := e.opts.CatalogPath + LeaseFileSuffix
	if err := os.WriteFile(lease, []byte(`{"epoch":3}`), 0o600); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(filepath.Dir(e.opts.Loader.PinRoot), "other")
	err := Cleanup(context.Background(), CleanupOptions{PinRoot: other, CatalogPath: e.opts.CatalogPath, InNamespace: e.lab.Node.Do})
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), fmt.Sprintf("this process (pid %d)", os.Getpid())) {
		t.Errorf("Cleanup of the catalog of an open dataplane: %v; want ErrInUse naming this process", err)
	}
	if files, err := catalog.JournalFiles(e.opts.CatalogPath); err != nil || len(files) == 0 {
		t.Errorf("catalog journal after the refused Cleanup: %v, %v", files, err)
	}
	if _, err := os.Stat(lease); err != nil {
		t.Errorf("lease file after the refused Cleanup: %v", err)
	}
	if _, err := os.Stat(other); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused Cleanup made a pin root: %v", err)
	}
	// Nor does an Open of that catalog on another pin root.
	opts := e.opts
	opts.Loader.PinRoot = other
	if d2, err := Open(context.Background(), opts); !errors.Is(err, ErrInUse) {
		if err == nil {
			d2.Close()
		}
		t.Errorf("Open of the catalog of an open dataplane: %v; want ErrInUse", err)
	}
	if _, err := os.Stat(other); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused Open made a pin root: %v", err)
	}
	echo(t, e.dial(t, vip4), "after the refused cleanup")
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := Cleanup(context.Background(), CleanupOptions{PinRoot: e.opts.Loader.PinRoot, CatalogPath: e.opts.CatalogPath, InNamespace: e.lab.Node.Do}); err != nil {
		t.Fatal(err)
	}
	if ents, err := os.ReadDir(filepath.Dir(e.opts.CatalogPath)); err != nil || len(ents) != 0 {
		t.Errorf("the catalog's directory after Cleanup: %v, %v; want it empty", ents, err)
	}
}

// TestCleanupRemovesPinRootLast: while Cleanup runs, a new Open (a
// daemon restarted) can take the pin root only after Cleanup removed
// everything else: the pin root directory is the last thing it removes,
// so the new dataplane's catalog and lease file stay. Cleanup used to
// remove the pin root first and then the catalog, the lease file and fq,
// the new dataplane's by then. (The new Open is played by LockPinRoot
// and the files it writes, at every step Cleanup takes.)
func TestCleanupRemovesPinRootLast(t *testing.T) {
	e := newEnv(t)
	d := e.open(t)
	if _, err := d.ApplyService(context.Background(), e.service(1, 1, 1)); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	root, lease := e.opts.Loader.PinRoot, e.opts.CatalogPath+LeaseFileSuffix
	var newer *bpf.PinRootLock
	var at string
	t.Cleanup(func() { cleanupStep = nil })
	cleanupStep = func(step string) {
		if newer != nil {
			return
		}
		lk, err := bpf.LockPinRoot(bpf.Options{PinRoot: root})
		if err != nil {
			return // held by Cleanup: as it must be
		}
		newer, at = lk, step
		for _, p := range []string{e.opts.CatalogPath, lease} {
			if err := os.WriteFile(p, []byte(`{"new":true}`), 0o600); err != nil {
				t.Error(err)
			}
		}
	}
	if err := Cleanup(context.Background(), CleanupOptions{PinRoot: root, CatalogPath: e.opts.CatalogPath, InNamespace: e.lab.Node.Do}); err != nil {
		t.Fatal(err)
	}
	cleanupStep = nil
	if newer == nil {
		t.Fatal("the pin root was never free during or at the end of Cleanup")
	}
	t.Cleanup(func() { newer.Release(); bpf.RemoveRoot(root) })
	if at != "pin root" {
		t.Errorf("a new Open could take the pin root after step %q of Cleanup; want only after the last (pin root)", at)
	}
	for _, p := range []string{e.opts.CatalogPath, lease} {
		if b, err := os.ReadFile(p); err != nil || string(b) != `{"new":true}` {
			t.Errorf("the new dataplane's %s after Cleanup: %q, %v", filepath.Base(p), b, err)
		}
	}
}

// TestOpenMountWarningUnderIPNetnsExec: fluxvm.Open under `ip netns
// exec` with Loader.MountBPFFS mounts bpffs in the process's private
// mount namespace (LockPinRoot does, before the loader) and logs the
// warning that the pins vanish at exit, with the `nsenter --net` advice.
// The warning was lost when LockPinRoot took the mount over from the
// loader, which then found bpffs mounted and said nothing.
func TestOpenMountWarningUnderIPNetnsExec(t *testing.T) {
	testenv.RequirePrivileged(t)
	ns := testenv.NewNetNS(t, "fvmwx")
	top := filepath.Join("/sys/fs/bpf", "fluxvm-mountwarn-"+testenv.Suffix())
	out := runChild(t, ns.Name, childJob{Do: "open", Loader: bpf.Options{PinRoot: filepath.Join(top, "service"), Tier: bpf.TierS, MountBPFFS: true}})
	if !strings.Contains(out, "open: ok") {
		t.Fatalf("Open under ip netns exec with MountBPFFS: %s", out)
	}
	if !strings.Contains(out, "level=WARN") || !strings.Contains(out, "vanish") || !strings.Contains(out, "nsenter --net=/run/netns/"+ns.Name) {
		t.Errorf("the log of Open under ip netns exec with MountBPFFS:\n%s\nwant the warning that the pins vanish, with the nsenter advice", out)
	}
	if _, err := os.Stat(top); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the child's pin root reached the host's BPF filesystem: %v", err)
	}
}
