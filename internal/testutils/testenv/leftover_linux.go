package testenv

import (
	"fmt"
	"os"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// FluxVMLeftovers lists what FluxVM may leave on the interfaces of the
// calling thread's network namespace (call it inside InNetNS or
// NetNS.Do): TCX and XDP programs whose name starts with "fluxvm",
// cls_bpf filters whose name does, and root qdiscs with FluxVM's handle
// (f1d0:, edt_manage_fq), and clsact qdiscs with no filter left (the
// cls_bpf attach adds one where there is none). Empty when a cleanup left
// nothing.
func FluxVMLeftovers() ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range links {
		name, index := l.Attrs().Name, l.Attrs().Index
		for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
			names, err := TCXProgramNames(index, at)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			for _, p := range names {
				if strings.HasPrefix(p, "fluxvm") {
					out = append(out, fmt.Sprintf("%s: %s program %s", name, at, p))
				}
			}
		}
		if x := l.Attrs().Xdp; x != nil && x.ProgId != 0 {
			if p, err := programName(ebpf.ProgramID(x.ProgId)); err == nil && strings.HasPrefix(p, "fluxvm") {
				out = append(out, fmt.Sprintf("%s: XDP program %s", name, p))
			}
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, _ := netlink.FilterList(l, parent) // no clsact: none
			for _, f := range fs {
				if bf, ok := f.(*netlink.BpfFilter); ok && strings.HasPrefix(bf.Name, "fluxvm") {
					out = append(out, fmt.Sprintf("%s: cls_bpf filter %s", name, bf.Name))
				}
			}
		}
		qs, err := netlink.QdiscList(l)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		for _, q := range qs {
			if q.Attrs().Parent == netlink.HANDLE_ROOT && q.Attrs().Handle == netlink.MakeHandle(0xf1d0, 0) {
				out = append(out, fmt.Sprintf("%s: root qdisc %s f1d0:", name, q.Type()))
			}
			if q.Type() == "clsact" && emptyClsact(l) {
				out = append(out, fmt.Sprintf("%s: clsact qdisc with no filter (the cls_bpf attach made it)", name))
			}
		}
	}
	return out, nil
}

// CgroupProgramNames names the programs attached directly to the cgroup
// v2 directory path on the socket hooks FluxVM uses.
func CgroupProgramNames(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	for _, at := range []ebpf.AttachType{
		ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
		ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
		ebpf.AttachCGroupUDP4Recvmsg, ebpf.AttachCGroupUDP6Recvmsg,
		ebpf.AttachCgroupInet4GetPeername, ebpf.AttachCgroupInet6GetPeername,
		ebpf.AttachCgroupInetSockRelease,
	} {
		r, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at})
		if err != nil {
			return nil, fmt.Errorf("%s: query %s: %w", path, at, err)
		}
		for _, p := range r.Programs {
			n, err := programName(p.ID)
			if err != nil {
				return nil, err
			}
			out = append(out, fmt.Sprintf("%s: %s", at, n))
		}
	}
	return out, nil
}

func programName(id ebpf.ProgramID) (string, error) {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return "", err
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return "", err
	}
	return info.Name, nil
}

// emptyClsact reports whether neither direction of l's clsact holds a
// filter.
func emptyClsact(l netlink.Link) bool {
	for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
		if fs, err := netlink.FilterList(l, parent); err != nil || len(fs) > 0 {
			return false
		}
	}
	return true
}
