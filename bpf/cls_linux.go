//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The cls_bpf attachment (clsact qdisc + direct-action filter), for kernels
// without TCX: netlink, so Linux only (cls_other.go elsewhere).

func clsParent(hook Hook) uint32 {
	if hook.ingress() {
		return netlink.HANDLE_MIN_INGRESS
	}
	return netlink.HANDLE_MIN_EGRESS
}

// attachClsBPF puts prog on the hook with our filter; reused: our filter
// of this hook (running the hook's program) was there already and was
// replaced. Our filter of the other hook of that direction (from_vm and
// ns_in share ingress, to_vm and ns_out egress: an interface whose role
// changed across a restart) is replaced too, but that is a new
// attachment of this hook, not a reuse.
func attachClsBPF(index int, hook Hook, prog *ebpf.Program, progName string) (reused bool, err error) {
	l, err := netlink.LinkByIndex(index)
	if err != nil {
		return false, fmt.Errorf("bpf: attach %s on %d (cls_bpf): %w", hook, index, err)
	}
	q := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	if err := netlink.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		return false, fmt.Errorf("bpf: attach %s on %d: clsact: %w", hook, index, err)
	}
	f, err := ourFilter(l, hook)
	if err != nil {
		return false, err
	}
	nf := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: index, Parent: clsParent(hook), Handle: netlink.MakeHandle(0, 1),
			Protocol: unix.ETH_P_ALL, Priority: 1,
		},
		Fd: prog.FD(), Name: clsPrefix + progName, DirectAction: true,
	}
	if f != nil {
		err = netlink.FilterReplace(nf)
	} else {
		err = netlink.FilterAdd(nf)
	}
	if err != nil {
		return false, fmt.Errorf("bpf: attach %s on %d (cls_bpf): %w", hook, index, err)
	}
	return f != nil && f.Name == clsPrefix+progName, nil
}

// ourClsFilterOf reports whether our filter of the hook (running its
// program, progName) is on interface index.
func ourClsFilterOf(index int, hook Hook, progName string) (bool, error) {
	l, err := netlink.LinkByIndex(index)
	if err != nil {
		return false, fmt.Errorf("bpf: attach %s on %d (cls_bpf): %w", hook, index, err)
	}
	f, err := ourFilter(l, hook)
	if err != nil {
		return false, err
	}
	return f != nil && f.Name == clsPrefix+progName, nil
}

// ourFilter returns our filter at priority 1 on the hook, nil when the
// slot is free, and ErrForeignProgram when someone else holds it.
func ourFilter(l netlink.Link, hook Hook) (*netlink.BpfFilter, error) {
	fs, err := netlink.FilterList(l, clsParent(hook))
	if err != nil {
		return nil, fmt.Errorf("bpf: list filters on %s: %w", l.Attrs().Name, err)
	}
	for _, f := range fs {
		if f.Attrs().Priority != 1 {
			continue
		}
		bf, ok := f.(*netlink.BpfFilter)
		if !ok || !strings.HasPrefix(bf.Name, clsPrefix) {
			return nil, fmt.Errorf("bpf: %s %s priority 1: %w", l.Attrs().Name, hook, ErrForeignProgram)
		}
		return bf, nil
	}
	return nil, nil
}

// detachClsBPF removes our cls_bpf filter from the hook of interface
// index (called name in errors). Our filter of another hook in the same
// direction (from_vm and ns_in are both ingress, to_vm and ns_out both
// egress) is not the hook's: detaching finds it not attached.
func detachClsBPF(index int, hook Hook, name string) error {
	l, err := netlink.LinkByIndex(index)
	if err != nil {
		return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, err)
	}
	f, err := ourFilter(l, hook)
	if err != nil {
		return err
	}
	if prog, _ := hook.program(); f == nil || f.Name != clsPrefix+prog {
		return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, ErrNotAttached)
	}
	if err := netlink.FilterDel(f); err != nil {
		return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, err)
	}
	return nil
}

// clsFilter is one of our cls_bpf filters.
type clsFilter struct {
	link netlink.Link
	f    *netlink.BpfFilter
}

// ourClsFilters lists our cls_bpf filters (priority 1, name prefix
// "fluxvm:") on every interface of the calling thread's network
// namespace, each once: a direction holds one filter at priority 1,
// whichever hook's program it runs.
func ourClsFilters() ([]clsFilter, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	var out []clsFilter
	for _, l := range links {
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(l, parent)
			if err != nil {
				continue // no clsact on it
			}
			for _, f := range fs {
				bf, ok := f.(*netlink.BpfFilter)
				if ok && bf.Priority == 1 && strings.HasPrefix(bf.Name, clsPrefix) {
					out = append(out, clsFilter{link: l, f: bf})
				}
			}
		}
	}
	return out, nil
}

// clsBPFAttachments lists our cls_bpf filters on every interface of the
// calling thread's network namespace, by the hook whose program each runs
// (its name after the prefix): one Attachment per filter.
func clsBPFAttachments() ([]Attachment, error) {
	fs, err := ourClsFilters()
	if err != nil {
		return nil, err
	}
	var out []Attachment
	for _, c := range fs {
		prog := strings.TrimPrefix(c.f.Name, clsPrefix)
		for _, hook := range Hooks {
			if p, _ := hook.program(); p == prog && clsParent(hook) == c.f.Parent {
				out = append(out, Attachment{Ifname: c.link.Attrs().Name, Ifindex: c.link.Attrs().Index, Hook: hook, Mode: AttachClsBPF, Program: prog})
			}
		}
	}
	return out, nil
}

// removeClsBPF deletes every cls_bpf filter of ours (ourClsFilters),
// whatever program it runs, in the calling thread's network namespace,
// and then the clsact qdisc of each interface it took them from when no
// filter is left on it (ours made it: attachClsBPF adds one where there
// is none; a clsact that still holds another program's filter stays).
func removeClsBPF() error {
	fs, err := ourClsFilters()
	if err != nil {
		return fmt.Errorf("bpf: cls_bpf filters: %w", err)
	}
	var errs []error
	touched := map[int]netlink.Link{}
	for _, c := range fs {
		if err := netlink.FilterDel(c.f); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("bpf: detach %s from %s (cls_bpf): %w", c.f.Name, c.link.Attrs().Name, err))
		}
		touched[c.link.Attrs().Index] = c.link
	}
	for _, l := range touched {
		if err := removeEmptyClsact(l); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeEmptyClsact deletes l's clsact qdisc when neither of its
// directions holds a filter.
func removeEmptyClsact(l netlink.Link) error {
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		fs, err := netlink.FilterList(l, parent)
		if err != nil || len(fs) > 0 {
			return nil // gone already, or someone else's filter is on it
		}
	}
	q := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
		QdiscType:  "clsact",
	}
	if err := netlink.QdiscDel(q); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("bpf: remove the empty clsact qdisc of %s: %w", l.Attrs().Name, err)
	}
	return nil
}
