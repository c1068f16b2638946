//go:build linux

package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/internal/bpffs"
	"github.com/fluxvm/servicefabric/internal/testutils/lab"
	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// BackendPort is where every backend VM's identity server listens.
const BackendPort = 8080

// The service's VIPs in every scenario.
var (
	VIP4 = netip.MustParseAddr("10.96.0.10")
	VIP6 = netip.MustParseAddr("fd00:96::10")
)

// Env is a lab with a running dataplane: client VM "vm1", backend VMs
// "vm2".. serving on BackendPort, and an external client behind the
// north-south interface.
type Env struct {
	Lab      *lab.Lab
	Client   *lab.VM
	Backends []*lab.VM
	DP       *fluxvm.Dataplane
	Options  fluxvm.Options

	servers []*lab.Server
	pinBase string
	tmp     string
}

// NewEnv builds the topology with n backend VMs and opens the dataplane
// in the node namespace (tier S, a pin root, catalog and advertisement
// snapshot of its own).
func NewEnv(n int, log *slog.Logger) (*Env, error) { return NewEnvConfig(n, log, nil) }

// NewEnvConfig is NewEnv with a hook that adjusts the node configuration
// (north-south interfaces, SNAT addresses, ...) before the dataplane opens.
func NewEnvConfig(n int, log *slog.Logger, configure func(*fluxvm.Config)) (e *Env, err error) {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	e = &Env{}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.Close())
			e = nil
		}
	}()
	if e.Lab, err = lab.New(); err != nil {
		return e, err
	}
	if e.Client, err = e.Lab.AddVM(1); err != nil {
		return e, err
	}
	for i := range n {
		vm, err := e.Lab.AddVM(i + 2)
		if err != nil {
			return e, err
		}
		srv, err := vm.Serve(BackendPort)
		if err != nil {
			return e, err
		}
		e.Backends = append(e.Backends, vm)
		e.servers = append(e.servers, srv)
	}
	if _, err = e.Lab.AddExternal(); err != nil {
		return e, err
	}
	if _, err := bpffs.Ensure(bpffs.DefaultRoot); err != nil {
		return e, err
	}
	e.pinBase = filepath.Join(bpffs.DefaultRoot, "fluxvm-lab-"+nsutil.Suffix())
	if e.tmp, err = os.MkdirTemp("", "fluxvm-lab-"); err != nil {
		return e, err
	}
	cfg := fluxvm.DefaultConfig()
	cfg.MapTier = "S"
	cfg.PinRoot = filepath.Join(e.pinBase, "service")
	cfg.CatalogPath = filepath.Join(e.tmp, "catalog.json")
	// The lab never writes the node's real snapshot under /run/fluxvm.
	cfg.AdvertisementsPath = filepath.Join(e.tmp, "service-advertisements.json")
	for _, vm := range e.Lab.VMs {
		cfg.VMEdgeInterfaces = append(cfg.VMEdgeInterfaces, fluxvm.VMEdgeInterface{Name: vm.NodeIf, VMID: vm.Name})
	}
	if configure != nil {
		configure(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		return e, err
	}
	e.Options = fluxvm.OptionsFrom(cfg)
	e.Options.Loader.Tier = bpf.TierS
	e.Options.InNamespace = e.Lab.Node.Do
	e.Options.Logger = log
	if e.DP, err = fluxvm.Open(context.Background(), e.Options); err != nil {
		return e, err
	}
	return e, nil
}

// Service is the scenario's service: both VIPs, port 80 over TCP and UDP,
// the backends (IPv4 and IPv6 addresses of each VM) with weights.
func (e *Env) Service(name string, weights []uint32) fluxvm.Service {
	s := fluxvm.Service{
		Name:  name,
		VIPs:  []netip.Addr{VIP4, VIP6},
		Ports: []fluxvm.ServicePort{{Port: 80, Protocol: fluxvm.TCP}, {Port: 80, Protocol: fluxvm.UDP}},
	}
	for i, vm := range e.Backends {
		w := uint32(1)
		if i < len(weights) {
			w = weights[i]
		}
		for _, a := range []netip.Addr{vm.Addr4, vm.Addr6} {
			s.Backends = append(s.Backends, fluxvm.Backend{Address: a, Port: BackendPort, Weight: &w})
		}
	}
	return s
}

// Backend returns the backend VM called name.
func (e *Env) Backend(name string) (*lab.VM, int, error) {
	for i, vm := range e.Backends {
		if vm.Name == name {
			return vm, i, nil
		}
	}
	return nil, 0, fmt.Errorf("scenario: no backend %q", name)
}

// Close removes everything: the dataplane's attachments, pins and catalog,
// the servers, and the namespaces.
func (e *Env) Close() error {
	var errs []error
	if e.DP != nil {
		errs = append(errs, e.DP.Cleanup(context.Background()))
		e.DP = nil
	}
	for _, s := range e.servers {
		errs = append(errs, s.Close())
	}
	e.servers = nil
	if e.Lab != nil {
		errs = append(errs, e.Lab.Close())
		e.Lab = nil
	}
	if e.pinBase != "" {
		if err := os.RemoveAll(e.pinBase); err != nil {
			errs = append(errs, err)
		}
	}
	if e.tmp != "" {
		errs = append(errs, os.RemoveAll(e.tmp))
	}
	return errors.Join(errs...)
}
