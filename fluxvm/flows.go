package fluxvm

import (
	"context"
	"fmt"
	"net"

	"github.com/cilium/ebpf"

	"github.com/fluxvm/servicefabric/flows"
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
// Flows takes the dataplane's lock only to copy the names and its own
// handles of the two maps, and reads the ring (at most its size of
// lookups) without it, so a long read never holds up Apply or Stats. A
// name that needs the node's namespace is looked up with the lock held,
// once the dataplane is known to be still open: Options.InNamespace is
// never called once Close began (an embedder may close its namespace
// handle after Close), and a read that Close overtakes fails with
// ErrClosed. After Close it fails with ErrClosed. A ctx that ends before
// the read, or while it reads the ring, fails with an error wrapping
// ctx's (a read changes nothing; the ring's read is not interrupted).
func (d *Dataplane) Flows(ctx context.Context, limit int, f flows.Filter) ([]flows.Record, error) {
	if err := d.begin(ctx, "flows"); err != nil {
		return nil, err
	}
	names, ifnames, ring, seq, err := d.flowSources()
	if err != nil {
		return nil, err
	}
	defer ring.Close()
	defer seq.Close()
	var closedErr error
	r := flows.Reader{
		Ring: ring,
		Seq:  seq,
		Service: func(id uint32) string {
			return names[id]
		},
		Interface: func(index int) string {
			if n, ok := ifnames[index]; ok {
				return n
			}
			// Not one of ours (or no longer): ask the node's namespace
			// once per Read and index, unless Close began.
			n, err := d.namespaceInterfaceName(index)
			if err != nil {
				closedErr = err
			}
			ifnames[index] = n
			return n
		},
	}
	if err := ctxErr(ctx, "flows"); err != nil {
		return nil, err
	}
	out, err := r.Read(limit, f)
	if err != nil {
		return nil, fmt.Errorf("fluxvm: %w", err)
	}
	if closedErr != nil {
		return nil, closedErr
	}
	if err := ctxErr(ctx, "flows"); err != nil {
		return nil, err
	}
	return out, nil
}

// namespaceInterfaceName is the name of the interface index in the node's
// namespace ("" when it has none), looked up under the lock while the
// dataplane is open: after Close it fails with ErrClosed and does not
// call Options.InNamespace.
func (d *Dataplane) namespaceInterfaceName(index int) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("flows"); err != nil {
		return "", err
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

// flowSources returns, under the lock, the service and interface names
// and handles of fluxvm_sflows and fluxvm_flow_seq of its own (the
// caller closes them), which stay valid after Close.
func (d *Dataplane) flowSources() (map[uint32]string, map[int]string, *ebpf.Map, *ebpf.Map, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpen("flows"); err != nil {
		return nil, nil, nil, nil, err
	}
	names := make(map[uint32]string, len(d.frontends))
	for _, fe := range d.frontends {
		names[fe.sid] = fe.service
	}
	ifnames := make(map[int]string, len(d.ifaces))
	for name, ifc := range d.ifaces {
		if ifc.index != 0 {
			ifnames[ifc.index] = name
		}
	}
	ring, err := d.dp.Maps().FluxvmSflows.Clone()
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("fluxvm: flows: %w", err)
	}
	seq, err := d.dp.Maps().FluxvmFlowSeq.Clone()
	if err != nil {
		ring.Close()
		return nil, nil, nil, nil, fmt.Errorf("fluxvm: flows: %w", err)
	}
	return names, ifnames, ring, seq, nil
}
