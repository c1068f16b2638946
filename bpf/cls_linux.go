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

// attachClsBPF puts prog on the hook with our filter; reused: ours was
// there already and was replaced.
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
	return f != nil, nil
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
// index (called name in errors).
func detachClsBPF(index int, hook Hook, name string) error {
	l, err := netlink.LinkByIndex(index)
	if err != nil {
		return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, err)
	}
	f, err := ourFilter(l, hook)
	if err != nil {
		return err
	}
	if f == nil {
		return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, ErrNotAttached)
	}
	if err := netlink.FilterDel(f); err != nil {
		return fmt.Errorf("bpf: detach %s from %s: %w", hook, name, err)
	}
	return nil
}

// clsBPFAttachments lists our cls_bpf filters on every interface of the
// calling thread's network namespace.
func clsBPFAttachments() ([]Attachment, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	var out []Attachment
	for _, l := range links {
		for _, hook := range Hooks {
			f, err := ourFilter(l, hook)
			if err != nil || f == nil {
				continue
			}
			out = append(out, Attachment{Ifname: l.Attrs().Name, Ifindex: l.Attrs().Index, Hook: hook, Mode: AttachClsBPF, Program: strings.TrimPrefix(f.Name, clsPrefix)})
		}
	}
	return out, nil
}
