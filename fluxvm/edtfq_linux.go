package fluxvm

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// rootQdisc returns the root qdisc of the interface, or nil when it has
// none listed.
func rootQdisc(link netlink.Link) (netlink.Qdisc, error) {
	qs, err := netlink.QdiscList(link)
	if err != nil {
		return nil, fmt.Errorf("interface %s: list qdiscs: %w", link.Attrs().Name, err)
	}
	for _, q := range qs {
		if q.Attrs().Parent == netlink.HANDLE_ROOT {
			return q, nil
		}
	}
	return nil, nil
}

// rootQdiscKind returns the kind of the interface's root qdisc ("fq",
// "noqueue", ...), or "" when it has none.
func rootQdiscKind(name string) (string, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return "", fmt.Errorf("interface %s: %w", name, err)
	}
	q, err := rootQdisc(link)
	if err != nil || q == nil {
		return "", err
	}
	return q.Type(), nil
}

// installFQ makes fq (fqKind) the root qdisc of interface name, in the
// calling thread's namespace, where the root is the kernel's default
// (handle 0:, which the kernel creates: noqueue, mq, pfifo_fast,
// fq_codel, ...). A root an operator configured (any other handle) is
// left alone: ErrConflict, naming it. Our own fq, left by an earlier
// start, is adopted. A kernel without the qdisc gives ErrNoFQ.
func installFQ(name string) (managedFQ, error) {
	m := managedFQ{name: name}
	link, err := netlink.LinkByName(name)
	if err != nil {
		return m, fmt.Errorf("edt_interfaces: interface %s: %w", name, err)
	}
	root, err := rootQdisc(link)
	if err != nil {
		return m, fmt.Errorf("edt_interfaces: %w", err)
	}
	ours := netlink.MakeHandle(fqHandleMajor, 0)
	if root != nil {
		a := root.Attrs()
		switch {
		case a.Handle == ours && root.Type() == fqKind:
			m.installed = true // an earlier start's
			return m, nil
		case a.Handle != 0:
			return m, fmt.Errorf("edt_interfaces: interface %s has a root qdisc configured by someone else (%s, handle %s); FluxVM replaces only the kernel's default root qdisc: install fq there yourself, or take the interface out of edt_interfaces: %w",
				name, root.Type(), netlink.HandleStr(a.Handle), ErrConflict)
		}
		m.previous = root.Type()
	}
	q := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: ours},
		QdiscType:  fqKind,
	}
	if err := netlink.QdiscAdd(q); err != nil {
		return m, fqAddError(name, err)
	}
	m.installed = true
	return m, nil
}

// removeFQ deletes the root qdisc installFQ put on m's interface, if it
// is still ours: the kernel then restores its default root. An
// interface that is gone, or whose root someone replaced since, is left
// as it is.
func removeFQ(m managedFQ) error {
	if !m.installed {
		return nil
	}
	link, err := netlink.LinkByName(m.name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("interface %s: %w", m.name, err)
	}
	root, err := rootQdisc(link)
	if err != nil {
		return err
	}
	if root == nil || root.Attrs().Handle != netlink.MakeHandle(fqHandleMajor, 0) {
		return nil
	}
	if err := netlink.QdiscDel(root); err != nil {
		return fmt.Errorf("interface %s: delete root %s: %w", m.name, root.Type(), err)
	}
	return nil
}

// fqAddError is the error of a failed attempt to create fq (fqKind) on
// interface name. Only ENOENT, which rtnetlink returns for a qdisc kind
// the kernel does not know (no sch_fq, built in or loadable), is ErrNoFQ,
// which edt_horizon_fallback accepts; every other failure (EOPNOTSUPP
// from a device, EINVAL, EPERM, ENOMEM, ...) fails as itself.
func fqAddError(name string, err error) error {
	if errors.Is(err, unix.ENOENT) {
		if fqKind == "fq" {
			return fmt.Errorf("edt_interfaces: interface %s: install fq: %w: %w", name, err, ErrNoFQ)
		}
		return fmt.Errorf("edt_interfaces: interface %s: install %s: the kernel has no such qdisc (%w): %w", name, fqKind, err, ErrNoFQ)
	}
	return fmt.Errorf("edt_interfaces: interface %s: install %s: %w", name, fqKind, err)
}
