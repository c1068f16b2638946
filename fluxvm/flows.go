package fluxvm

import (
	"context"
	"fmt"
	"net"

	"github.com/fluxvm/servicefabric/flows"
	flowview "github.com/fluxvm/servicefabric/fluxvm/internal/flows"
)

// Flows returns up to limit FluxScope flow records that f keeps, newest
// first (flows.Reader.Read over fluxvm_sflows): limit 1..flows.MaxLimit,
// else an error matching flows.ErrLimit. Records exist only while
// Options.FlowSampleRate is not 0.
//
// Service names come from the frontends' service ids as they are now: a
// record of a frontend deleted since has an empty Service (its ServiceID
// stays); a service id reused by a newer frontend names that one.
// Interface names come from the attached interfaces, then from the node's
// namespace (Options.InNamespace), else "if<index>".
//
// Flows takes the dataplane's lock only to copy the names, and reads the
// ring (at most its size of lookups) on handles of its own without it
// (package fluxvm/internal/flows), so a long read never holds up Apply
// or Stats. A name that needs the node's namespace is looked up with the
// lock held, once the dataplane is known to be still open:
// Options.InNamespace is never called once Close began (an embedder may
// close its namespace handle after Close), and a read that Close
// overtakes fails with ErrClosed. After Close it fails with ErrClosed. A
// ctx that ends before the read, or while it reads the ring, fails with
// an error wrapping ctx's (a read changes nothing; the ring's read is not
// interrupted).
func (d *Dataplane) Flows(ctx context.Context, limit int, f flows.Filter) ([]flows.Record, error) {
	if err := d.begin(ctx, "flows"); err != nil {
		return nil, err
	}
	names, err := d.flowNames()
	if err != nil {
		return nil, err
	}
	out, err := d.scope.Flows(ctx, limit, f, names)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: %w", err)
	}
	return out, nil
}

// flowNames copies, under the lock, the names of the frontends' service
// ids and of the attached interfaces' indexes.
func (d *Dataplane) flowNames() (flowview.Names, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("flows"); err != nil {
		return flowview.Names{}, err
	}
	names := flowview.Names{Services: make(map[uint32]string, d.prog.Len()), Interfaces: make(map[int]string, len(d.ifaces))}
	for _, fe := range d.prog.Frontends() {
		names.Services[fe.ID()] = fe.Service()
	}
	for name, ifc := range d.ifaces {
		if ifc.index != 0 {
			names.Interfaces[ifc.index] = name
		}
	}
	return names, nil
}

// namespaceInterfaceName is the name of the interface index in the node's
// namespace ("" when it has none), looked up under the lock while the
// dataplane is open: after Close it fails with ErrClosed and does not
// call Options.InNamespace. It is the flows component's
// Deps.InterfaceName, which Flows wraps with "fluxvm: ".
func (d *Dataplane) namespaceInterfaceName(index int) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return "", fmt.Errorf("flows: %w", ErrClosed)
	}
	var n string
	_ = d.opts.InNamespace(func() error {
		if ifc, err := net.InterfaceByIndex(index); err == nil {
			n = ifc.Name
		}
		return nil
	})
	return n, nil
}
