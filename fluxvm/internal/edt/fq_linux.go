package edt

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/intent"
)

// infoOf is what mode detection needs of a qdisc.
func infoOf(q netlink.Qdisc) qdiscInfo {
	a := q.Attrs()
	return qdiscInfo{kind: q.Type(), handle: a.Handle, parent: a.Parent}
}

// listQdiscs lists the qdiscs of the interface.
func listQdiscs(link netlink.Link) ([]netlink.Qdisc, error) {
	qs, err := netlink.QdiscList(link)
	if err != nil {
		return nil, fmt.Errorf("interface %s: list qdiscs: %w", link.Attrs().Name, err)
	}
	return qs, nil
}

// rootQdisc returns the root qdisc of the interface, or nil when it has
// none listed.
func rootQdisc(link netlink.Link) (netlink.Qdisc, error) {
	qs, err := listQdiscs(link)
	if err != nil {
		return nil, err
	}
	for _, q := range qs {
		if q.Attrs().Parent == netlink.HANDLE_ROOT {
			return q, nil
		}
	}
	return nil, nil
}

// qdiscsOf lists the qdiscs of interface name, for fqInForce.
func qdiscsOf(name string) ([]qdiscInfo, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", name, err)
	}
	qs, err := listQdiscs(link)
	if err != nil {
		return nil, err
	}
	out := make([]qdiscInfo, 0, len(qs))
	for _, q := range qs {
		out = append(out, infoOf(q))
	}
	return out, nil
}

// installFQ makes fq (fqKind) hold the packets of interface name, in the
// calling thread's namespace, where the root is the kernel's default
// (handle 0:, which the kernel creates: noqueue, pfifo_fast, fq_codel,
// mq, ...):
//
//   - a single-queue default root is replaced by fq, handle f1d0:;
//   - a multi-queue device's default root, mq, is replaced by an mq of
//     ours (handle f1d0:), with fq as the child of each of its classes
//     (one per TX queue), so that every TX queue keeps a qdisc (and lock)
//     of its own. Deleting the children alone would not do at removal:
//     the kernel leaves a TX queue whose mq child is deleted with noop,
//     which drops every packet; deleting our mq root instead makes the
//     kernel attach its default mq and children again.
//
// A root an operator configured (any other handle, mq included) is left
// alone: ErrConflict, naming it. Our own root, left by an earlier start,
// is adopted (an mq of ours gets fq on any class that lacks it). A kernel
// without the qdisc gives ErrNoFQ.
func installFQ(name string) (managedFQ, error) {
	m := managedFQ{name: name}
	link, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return m, fmt.Errorf("edt_interfaces: interface %q: no such network interface: %w", name, errs.ErrNotFound)
		}
		return m, fmt.Errorf("edt_interfaces: interface %q: %w", name, err)
	}
	root, err := rootQdisc(link)
	if err != nil {
		return m, fmt.Errorf("edt_interfaces: %w", err)
	}
	ours := netlink.MakeHandle(HandleMajor, 0)
	mq := false
	if root != nil {
		a := root.Attrs()
		switch {
		case a.Handle == ours && root.Type() == fqKind:
			m.installed, m.adopted = true, true // an earlier start's
			return m, nil
		case a.Handle == ours && root.Type() == "mq":
			m.installed, m.adopted = true, true
			return m, fillMQ(link)
		case a.Handle != 0 && root.Type() == "mq":
			return m, fmt.Errorf("edt_interfaces: interface %s has a root qdisc configured by someone else (mq, handle %s); FluxVM replaces only the kernel's default root qdisc: install fq on its classes yourself (tc qdisc replace dev %s parent %s1 fq, and so on for each TX queue), or take the interface out of edt_interfaces: %w",
				name, netlink.HandleStr(a.Handle), name, netlink.HandleStr(a.Handle), intent.ErrConflict)
		case a.Handle != 0:
			return m, fmt.Errorf("edt_interfaces: interface %s has a root qdisc configured by someone else (%s, handle %s); FluxVM replaces only the kernel's default root qdisc: install fq there yourself, or take the interface out of edt_interfaces: %w",
				name, root.Type(), netlink.HandleStr(a.Handle), intent.ErrConflict)
		}
		m.previous = root.Type()
		mq = root.Type() == "mq"
	}
	if mq {
		q := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Parent: netlink.HANDLE_ROOT, Handle: ours},
			QdiscType:  "mq",
		}
		if err := netlink.QdiscReplace(q); err != nil {
			return m, fmt.Errorf("edt_interfaces: interface %s: replace the default mq by one of FluxVM's: %w", name, err)
		}
		m.installed = true
		if err := fillMQ(link); err != nil {
			if rerr := removeFQ(m); rerr != nil {
				err = errors.Join(err, rerr)
			}
			m.installed = false
			return m, err
		}
		return m, nil
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

// fillMQ gives every class of our mq root (f1d0:1, f1d0:2, ...) fq as
// its child, where it has another (the kernel's default, as mq created
// it). The kernel picks the children's handles.
func fillMQ(link netlink.Link) error {
	qs, err := listQdiscs(link)
	if err != nil {
		return fmt.Errorf("edt_interfaces: %w", err)
	}
	for _, q := range qs {
		a := q.Attrs()
		if a.Parent == netlink.HANDLE_ROOT || a.Parent>>16 != HandleMajor || a.Parent&0xffff == 0 || q.Type() == fqKind {
			continue
		}
		child := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link.Attrs().Index, Parent: a.Parent},
			QdiscType:  fqKind,
		}
		if err := netlink.QdiscReplace(child); err != nil {
			return fmt.Errorf("%w (mq class %s)", fqAddError(link.Attrs().Name, err), netlink.HandleStr(a.Parent))
		}
	}
	return nil
}

// removeFQ deletes the root qdisc installFQ put on m's interface (fq, or
// our mq with its fq children), if it is still ours: the kernel then
// restores its default root. An interface that is gone, or whose root
// someone replaced since, is left as it is.
func removeFQ(m managedFQ) error {
	if !m.installed {
		return nil
	}
	_, err := removeOurRoot(m.name)
	return err
}

// removeOurRoot deletes the root qdisc of interface name if it has our
// handle (f1d0:), and reports whether it did. A missing interface is not
// an error.
func removeOurRoot(name string) (bool, error) {
	link, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return false, nil
		}
		return false, fmt.Errorf("interface %s: %w", name, err)
	}
	root, err := rootQdisc(link)
	if err != nil {
		return false, err
	}
	if root == nil || root.Attrs().Handle != netlink.MakeHandle(HandleMajor, 0) {
		return false, nil
	}
	if err := netlink.QdiscDel(root); err != nil {
		return false, fmt.Errorf("interface %s: delete root %s: %w", name, root.Type(), err)
	}
	return true, nil
}

// removeStrayFQ deletes our root qdisc (handle f1d0:) from every
// interface of the calling thread's namespace not in keep, and returns
// the names of the interfaces it removed it from.
func removeStrayFQ(keep map[string]bool) ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	var (
		removed []string
		errs    []error
	)
	for _, l := range links {
		name := l.Attrs().Name
		if keep[name] {
			continue
		}
		ok, err := removeOurRoot(name)
		if err != nil {
			errs = append(errs, err)
		}
		if ok {
			removed = append(removed, name)
		}
	}
	return removed, errors.Join(errs...)
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
