package fluxvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	toml "github.com/pelletier/go-toml/v2"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/catalog"
	"github.com/fluxvm/servicefabric/fluxvm/internal/edt"
	"github.com/fluxvm/servicefabric/fluxvm/internal/hasync"
	"github.com/fluxvm/servicefabric/internal/bpffs"
)

// ErrInUse: the pin root is held by an open Dataplane, in this process or
// another (a running fluxvmd). Open and Cleanup fail with it, naming the
// holder where the kernel tells it, and change nothing. It is
// bpf.ErrInUse, so errors.Is holds with either name.
var ErrInUse = bpf.ErrInUse

// LeaseFileSuffix names the HA lease file kept next to the catalog:
// CatalogPath + LeaseFileSuffix (see HAOptions).
const LeaseFileSuffix = ".ha-lease"

// CleanupOptions say where a node's FluxVM state lives: all that Cleanup
// needs. CleanupOptionsFrom and ParseCleanupConfig fill them from a
// configuration.
type CleanupOptions struct {
	// PinRoot is the datapath's pin root (bpf.Options.PinRoot; empty:
	// bpf.DefaultPinRoot).
	PinRoot string
	// CatalogPath is the catalog (Options.CatalogPath); empty: none.
	// Its journal files and the HA lease file next to it
	// (CatalogPath + LeaseFileSuffix) go with it.
	CatalogPath string
	// AdvertisementsPath, when set, receives a snapshot with no entries
	// (continuing the file's generation), so that routing adapters
	// withdraw every VIP; NodeName is its node field.
	AdvertisementsPath string
	NodeName           string
	// InNamespace runs the interface work (detaching cls_bpf filters,
	// removing fq) in the node's network namespace, as
	// Options.InNamespace. Default: the calling thread's namespace.
	InNamespace func(func() error) error
	// Logger receives what was removed; default slog.Default().
	Logger *slog.Logger
}

// CleanupOptionsFrom returns the CleanupOptions of a configuration: its
// pin_root, catalog_path, advertisements_path and node_name.
func CleanupOptionsFrom(cfg Config) CleanupOptions {
	return CleanupOptions{PinRoot: cfg.PinRoot, CatalogPath: cfg.CatalogPath, AdvertisementsPath: cfg.AdvertisementsPath, NodeName: cfg.NodeName}
}

// ParseCleanupConfig reads from a TOML document only the keys of its
// [sandbox.dataplane.service] table that say where state lives (pin_root,
// catalog_path, advertisements_path, node_name; DefaultConfig's value for
// each one left out) and ignores every other key and table without
// checking it: a configuration edited or downgraded into one that
// ParseConfig refuses can still be cleaned up. The four keys must be
// strings, the paths absolute (ErrInvalid naming the key otherwise).
func ParseCleanupConfig(data []byte) (CleanupOptions, error) {
	def := DefaultConfig()
	var doc struct {
		Sandbox struct {
			Dataplane struct {
				Service struct {
					PinRoot            *string `toml:"pin_root"`
					CatalogPath        *string `toml:"catalog_path"`
					AdvertisementsPath *string `toml:"advertisements_path"`
					NodeName           *string `toml:"node_name"`
				} `toml:"service"`
			} `toml:"dataplane"`
		} `toml:"sandbox"`
	}
	if err := toml.NewDecoder(bytes.NewReader(data)).Decode(&doc); err != nil {
		return CleanupOptions{}, fmt.Errorf("fluxvm: cleanup config: %w", err)
	}
	s := doc.Sandbox.Dataplane.Service
	o := CleanupOptions{PinRoot: def.PinRoot, CatalogPath: def.CatalogPath, AdvertisementsPath: def.AdvertisementsPath, NodeName: def.NodeName}
	var errs []error
	for _, k := range []struct {
		key string
		in  *string
		out *string
	}{{"pin_root", s.PinRoot, &o.PinRoot}, {"catalog_path", s.CatalogPath, &o.CatalogPath}, {"advertisements_path", s.AdvertisementsPath, &o.AdvertisementsPath}} {
		if k.in == nil {
			continue
		}
		*k.out = *k.in
		if !filepath.IsAbs(*k.in) {
			errs = append(errs, verr(ErrInvalid, configKey(k.key), "%q is not an absolute path", *k.in))
		}
	}
	if s.NodeName != nil {
		o.NodeName = *s.NodeName
	}
	if err := errors.Join(errs...); err != nil {
		return CleanupOptions{}, fmt.Errorf("fluxvm: cleanup config: %w", err)
	}
	return o, nil
}

// Cleanup removes everything a dataplane on o.PinRoot owns, with no
// dataplane running and nothing loaded: it takes the pin root and the
// catalog's lock file as Open does (failing with ErrInUse, naming the
// holder, while a Dataplane holds either: a running fluxvmd; nothing is
// changed then), and refuses with ErrPinRoot, changing nothing, a pin
// root it does not see while it cannot see the node's bpffs either (run
// under `ip netns exec`: the error advises `nsenter --net`;
// bpf.CheckPinRootVisible). It detaches every attachment
// the datapath recorded (TCX, XDP and socket-hook links, pinned by
// interface index or cgroup id, so an interface or cgroup renamed or gone
// does not stop it) and our cls_bpf filters in the node's namespace,
// removes the pin root (and the parents of it that Open created, when
// they are empty), FluxVM's fq qdiscs (handle f1d0:) from every interface
// of the namespace, the catalog with its journal, and the HA lease file
// next to the catalog, and publishes an empty advertisement snapshot. The
// pin root directory goes last, and then the catalog's lock file: a
// dataplane opened meanwhile loses nothing. cls_bpf filters and fq are
// found by name and handle, in the whole network namespace: in cls_bpf
// mode, one dataplane per network namespace.
//
// The HA lease file is removed: it records the newest lease epoch this
// edge was given and the one that fenced it, and a cleanup is a
// decommission. The fence guards the flow state this edge holds against a
// newer edge's, and Cleanup removes that state with it; the node that
// comes back is a new member, whose lease the control plane gives it
// (ha_epoch, or UpdateLease), and whose standbys resync from a snapshot.
// Cleanup logs the epochs it forgets.
//
// A pin root, catalog or file that does not exist is not an error, so
// Cleanup can be repeated. Every step is tried; the error joins those
// that failed.
//
// A ctx that ended before Cleanup removes anything (on entry, or while it
// took the locks) changes nothing and fails with an error wrapping ctx's.
// Once it removes, it is past its point of no return and finishes every
// step whatever ctx says (a half-removed datapath is worse than either).
func Cleanup(ctx context.Context, o CleanupOptions) error {
	if err := ctxErr(ctx, "cleanup"); err != nil {
		return err
	}
	if o.PinRoot == "" {
		o.PinRoot = bpf.DefaultPinRoot
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.InNamespace == nil {
		o.InNamespace = func(f func() error) error { return f() }
	}
	if root := filepath.Clean(o.PinRoot); !filepath.IsAbs(o.PinRoot) || root == "/" || root == bpffs.DefaultRoot {
		return fmt.Errorf("fluxvm: cleanup: pin root %q: %w: absolute, a directory of its own below a bpffs mount", o.PinRoot, bpf.ErrPinRoot)
	}
	if o.CatalogPath != "" && !filepath.IsAbs(o.CatalogPath) {
		return fmt.Errorf("fluxvm: cleanup: %w", verr(ErrInvalid, "CatalogPath", "%q is not an absolute path", o.CatalogPath))
	}
	if o.AdvertisementsPath != "" && !filepath.IsAbs(o.AdvertisementsPath) {
		return fmt.Errorf("fluxvm: cleanup: %w", verr(ErrInvalid, "AdvertisementsPath", "%q is not an absolute path", o.AdvertisementsPath))
	}
	cl, lk, err := lockForCleanup(o)
	if err != nil {
		return fmt.Errorf("fluxvm: cleanup: %w", err)
	}
	if err := ctxErr(ctx, "cleanup"); err != nil {
		return errors.Join(err, cl.Abandon(), lk.Release())
	}
	var errs []error
	if o.AdvertisementsPath != "" {
		if err := withdrawAll(o); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, removeState(o), cl.Remove(), lk.Release())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("fluxvm: cleanup: %w", err)
	}
	return nil
}

// lockForCleanup holds the pin root, creating none, and then the
// catalog's lock file, as Open takes them (the catalog's covers the
// state outside bpffs even where the pin root cannot be held). A pin
// root that does not exist needs no lock (no dataplane runs on it; the
// rest is cleaned up all the same), but only when this process would see
// it: under `ip netns exec` (a private /sys hiding the node's bpffs), or
// in another mount namespace that does not show the node's bpffs, a
// running dataplane's pin root is missing here too, and Cleanup fails
// with ErrPinRoot and its advice instead (bpf.CheckPinRootVisible),
// before it changes anything.
func lockForCleanup(o CleanupOptions) (*catalog.Lock, *bpf.PinRootLock, error) {
	var lk *bpf.PinRootLock
	if _, err := os.Stat(o.PinRoot); errors.Is(err, fs.ErrNotExist) {
		if err := bpf.CheckPinRootVisible(o.PinRoot); err != nil {
			return nil, nil, err
		}
	} else if lk, err = bpf.LockPinRoot(bpf.Options{PinRoot: o.PinRoot}); err != nil {
		return nil, nil, err
	}
	var cl *catalog.Lock
	if _, err := os.Stat(filepath.Dir(o.CatalogPath)); o.CatalogPath != "" && err == nil {
		// (No directory, no catalog: nothing there to hold.)
		if cl, err = catalog.TakeLock(o.CatalogPath); err != nil {
			return nil, nil, errors.Join(err, lk.Release())
		}
	}
	return cl, lk, nil
}

// withdrawAll publishes a snapshot with no entries.
func withdrawAll(o CleanupOptions) error {
	p, err := advert.NewPublisher(advert.Options{Path: o.AdvertisementsPath, Node: o.NodeName, Logger: o.Logger})
	if err != nil {
		return fmt.Errorf("advertisements: %w", err)
	}
	if _, _, err := p.Publish([]advert.Entry{}); err != nil {
		return fmt.Errorf("advertisements: the empty snapshot that withdraws every VIP was not published: %w", err)
	}
	return nil
}

// cleanupStep, when set (a test), is called after each step of
// removeState with the step's name.
var cleanupStep func(step string)

// removeState removes the datapath under o.PinRoot, FluxVM's fq, the
// catalog and the HA lease file (Cleanup and Dataplane.Cleanup, with the
// pin root held). The pin root directory goes last, just before the
// caller lets the lock go: once it is gone, a new Open (a restarted
// daemon) can create and lock a new one, and nothing of the new
// dataplane's may be removed after that.
func removeState(o CleanupOptions) error {
	step := func(name string) {
		if cleanupStep != nil {
			cleanupStep(name)
		}
	}
	var errs []error
	errs = append(errs, o.InNamespace(func() error { return bpf.RemovePins(o.PinRoot) }))
	step("pins")
	errs = append(errs, edt.RemoveAll(edt.Config{InNamespace: o.InNamespace, Logger: o.Logger}))
	step("fq")
	if o.CatalogPath != "" {
		if err := catalog.Remove(o.CatalogPath); err != nil {
			errs = append(errs, fmt.Errorf("catalog %s: %w", o.CatalogPath, err))
		}
		step("catalog")
		errs = append(errs, removeLease(o.CatalogPath+LeaseFileSuffix, o.Logger))
		step("lease")
	}
	if err := bpf.RemoveRootDir(o.PinRoot); err != nil && !errors.Is(err, bpf.ErrPinRoot) {
		errs = append(errs, err)
	}
	step("pin root")
	o.Logger.Info("fluxvm: cleanup: removed the datapath, its pins, FluxVM's fq and the catalog",
		"pin_root", o.PinRoot, "catalog_path", o.CatalogPath)
	return errors.Join(errs...)
}

// removeLease removes the HA lease file at path, logging the epochs it
// forgets.
func removeLease(path string, log *slog.Logger) error {
	lf, err := hasync.ReadLease(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err == nil {
		log.Warn("fluxvm: cleanup: HA lease file removed: this edge no longer remembers its lease; the control plane gives it one when it rejoins",
			"file", path, "epoch", lf.Epoch, "superseded_by", lf.SupersededBy)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("ha lease: %w", err)
	}
	return nil
}

// cleanupOptions are the CleanupOptions of the dataplane's own state.
func (d *Dataplane) cleanupOptions() CleanupOptions {
	return CleanupOptions{PinRoot: d.dp.Status().PinRoot, CatalogPath: d.opts.CatalogPath, AdvertisementsPath: d.opts.AdvertisementsPath,
		NodeName: d.opts.NodeName, InNamespace: d.opts.InNamespace, Logger: d.log}
}
