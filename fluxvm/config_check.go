package fluxvm

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/intent"
)

// Checking a configuration, and what Open takes from it.

// Validate checks every key of the configuration and returns nil or all
// the problems found, joined, each a *ValidationError whose Field is the
// full TOML key:
//
//   - map_tier S, M or L; pin_root absolute and not a bpffs mount point;
//     object_dir empty or absolute; attach_mode "", "tcx" or "cls_bpf";
//     catalog_path absolute; advertisements_path absolute, naming a file,
//     and not catalog_path; health_check_concurrency 0..1024;
//     flow_sample_rate 0..65536; node_name
//     empty or at most 253 printable ASCII
//     characters without white space;
//   - conntrack_gc_interval 1s..1h; each conntrack timeout a whole number
//     of seconds in 2s..168h;
//   - vm_edge_interfaces: valid, unique interface names (1..15 characters),
//     non-empty VM ids; north_south_interfaces: valid names, unique, none
//     also a VM edge; xdp_mode "off" (or empty), "native", "generic" or
//     "auto"; xdp_egress_interfaces: valid, unique names, and xdp_mode
//     set;
//   - snat_address: unset or a unicast IPv4 or IPv6 address (no zone, not
//     loopback or link-local); snat_address_v6: unset or such an IPv6
//     address, and then snat_address, if set, is IPv4;
//   - snat_port_min and snat_port_max: 1024..65535 each, min <= max;
//   - advertise_snat: only with an SNAT address;
//   - cgroup_path: empty, or an absolute path and then cgroup_connect
//     true;
//   - edt_horizon bpf.MinEDTHorizon..bpf.MaxEDTHorizon (1ms..10s);
//     edt_interfaces: valid, unique interface names; edt_manage_fq needs
//     edt_enabled and edt_interfaces, edt_interfaces and
//     edt_horizon_fallback need edt_manage_fq (ErrPrerequisite);
//   - pressure_soft_percent and pressure_hard_percent 1..100, soft below
//     hard; pressure_interval 100ms..1h;
//   - ha_epoch needs north_south_interfaces (ErrPrerequisite);
//     ha_interval 100ms..1m; ha_journal_max_ops 0..4194304.
//
// Validate reads no files: whether they exist is the program's concern.
// The reference daemon's api sub-table is validated by the daemon.
func (c *Config) Validate() error {
	if err := c.validate(); err != nil {
		return fmt.Errorf("fluxvm: config: %w", err)
	}
	return nil
}

func (c *Config) validate() error {
	var errs []error
	bad := func(category error, k, format string, args ...any) {
		errs = append(errs, verr(category, configKey(k), format, args...))
	}
	if _, err := bpf.ParseTier(c.MapTier); err != nil {
		bad(ErrInvalid, "map_tier", "%q is not a map tier (want S, M or L)", c.MapTier)
	}
	switch root := filepath.Clean(c.PinRoot); {
	case !filepath.IsAbs(c.PinRoot):
		bad(ErrInvalid, "pin_root", "%q is not an absolute path", c.PinRoot)
	case root == "/" || root == "/sys/fs/bpf":
		bad(ErrInvalid, "pin_root", "%q must be a directory of its own below a bpffs mount, e.g. %s", c.PinRoot, bpf.DefaultPinRoot)
	}
	if c.ObjectDir != "" && !filepath.IsAbs(c.ObjectDir) {
		bad(ErrInvalid, "object_dir", "%q is not an absolute path", c.ObjectDir)
	}
	switch c.AttachMode {
	case "", bpf.AttachTCX, bpf.AttachClsBPF:
	default:
		bad(ErrInvalid, "attach_mode", "%q is not an attach mode (want \"\" for automatic, %q or %q)", c.AttachMode, bpf.AttachTCX, bpf.AttachClsBPF)
	}
	if !filepath.IsAbs(c.CatalogPath) {
		bad(ErrInvalid, "catalog_path", "%q is not an absolute path", c.CatalogPath)
	}
	switch ap := c.AdvertisementsPath; {
	case !filepath.IsAbs(ap):
		bad(ErrInvalid, "advertisements_path", "%q is not an absolute path", ap)
	case strings.HasSuffix(ap, "/") || filepath.Clean(ap) == "/":
		bad(ErrInvalid, "advertisements_path", "%q names a directory; name the snapshot file, e.g. %s", ap, advert.DefaultPath)
	case filepath.IsAbs(c.CatalogPath) && filepath.Clean(ap) == filepath.Clean(c.CatalogPath):
		bad(ErrConflict, "advertisements_path", "%q is also catalog_path; the snapshot needs a file of its own", ap)
	}
	// What a file must state: a key set to 0 where Options' zero means
	// "the default" is refused (leave the key out for the default), and
	// the GC runs within the file's bounds (the library takes shorter
	// periods, for tests).
	for _, z := range []struct {
		k     string
		zero  bool
		v     any
		valid string
	}{
		{"pressure_soft_percent", c.PressureSoftPercent == 0, 0, "1..100"},
		{"pressure_hard_percent", c.PressureHardPercent == 0, 0, "1..100"},
		{"pressure_interval", c.PressureInterval.Duration <= 0, c.PressureInterval.Duration, fmt.Sprintf("%v..%v", MinPressureInterval, MaxPressureInterval)},
		{"ha_interval", c.HAInterval.Duration == 0, 0, fmt.Sprintf("%v..%v", MinHAInterval, MaxHAInterval)},
		{"edt_horizon", c.EDTHorizon.Duration == 0, 0, fmt.Sprintf("%v..%v", bpf.MinEDTHorizon, bpf.MaxEDTHorizon)},
		{"snat_port_min", c.SNATPortMin == 0, 0, fmt.Sprintf("%d..%d", MinSNATPort, MaxSNATPort)},
		{"snat_port_max", c.SNATPortMax == 0, 0, fmt.Sprintf("%d..%d", MinSNATPort, MaxSNATPort)},
	} {
		if z.zero {
			bad(ErrInvalid, z.k, "%v is outside %s (leave the key out for the default)", z.v, z.valid)
		}
	}
	if d := c.ConntrackGCInterval.Duration; d < MinConntrackGCInterval || d > MaxConntrackGCInterval {
		bad(ErrInvalid, "conntrack_gc_interval", "%v is outside %v..%v", d, MinConntrackGCInterval, MaxConntrackGCInterval)
	}
	for _, t := range []struct {
		k string
		d time.Duration
	}{
		{"tcp_syn_timeout", c.TCPSynTimeout.Duration},
		{"tcp_established_timeout", c.TCPEstablishedTimeout.Duration},
		{"tcp_fin_timeout", c.TCPFinTimeout.Duration},
		{"tcp_rst_timeout", c.TCPRstTimeout.Duration},
		{"udp_timeout", c.UDPTimeout.Duration},
	} {
		switch {
		case t.d < conntrack.MinTimeout || t.d > conntrack.MaxTimeout:
			bad(ErrInvalid, t.k, "%v is outside %v..%v", t.d, conntrack.MinTimeout, conntrack.MaxTimeout)
		case t.d%time.Second != 0:
			bad(ErrInvalid, t.k, "%v is not a whole number of seconds (the datapath keeps seconds)", t.d)
		}
	}
	// Every other rule is Options' (one source of truth), naming keys.
	if err := OptionsFrom(*c).check(configNames, checkConfig); err != nil {
		errs = append(errs, err)
	}
	for _, e := range intent.CheckNode(c.Node()) {
		bad(e.Kind, e.Field, "%s", e.Reason)
	}
	return errors.Join(errs...)
}

// snatAddrProblem says what is wrong with a as an SNAT address, or "".
// Backends must route replies to it across the network, so it has the
// rules of a VIP (no link-local) and is never IPv4-mapped.
func snatAddrProblem(a netip.Addr) string {
	if a.Is4In6() {
		return fmt.Sprintf("%s is an IPv4-mapped IPv6 address; write the IPv4 address %s in snat_address", a, a.Unmap())
	}
	return intent.AddrProblem(a, true)
}

// SNATAddressFor returns the SNAT address of a family (v6 false: IPv4),
// or the zero Addr when the configuration has none: IPv4 is snat_address
// if that is IPv4; IPv6 is snat_address_v6, else snat_address if that is
// IPv6.
func (c *Config) SNATAddressFor(v6 bool) netip.Addr {
	switch {
	case !v6 && c.SNATAddress.Is4():
		return c.SNATAddress
	case v6 && c.SNATAddressV6.Is6() && !c.SNATAddressV6.Is4In6():
		return c.SNATAddressV6
	case v6 && c.SNATAddress.Is6() && !c.SNATAddress.Is4In6():
		return c.SNATAddress
	}
	return netip.Addr{}
}

// SNATConfig returns the value of the datapath's fluxvm_snat entry for
// this configuration: the address of each family it has, and the port
// range. A range left 0..0 (a Config not built from DefaultConfig) takes
// the defaults.
func (c *Config) SNATConfig() bpf.SNATConfig {
	var v bpf.SNATConfig
	if a := c.SNATAddressFor(false); a.IsValid() {
		v.Addr4 = bpf.AddrWords(a)[0]
		v.Flags |= bpf.SNATFlagV4
	}
	if a := c.SNATAddressFor(true); a.IsValid() {
		v.Addr6 = bpf.AddrWords(a)
		v.Flags |= bpf.SNATFlagV6
	}
	lo, hi := c.SNATPortMin, c.SNATPortMax
	if lo == 0 && hi == 0 {
		lo, hi = DefaultSNATPortMin, DefaultSNATPortMax
	}
	v.PortMin, v.PortMax = uint16(min(max(lo, 0), MaxSNATPort)), uint16(min(max(hi, 0), MaxSNATPort))
	return v
}

// ifnameProblem applies the kernel's rules for interface names
// (dev_valid_name), or returns "".
func ifnameProblem(n string) string {
	switch {
	case n == "":
		return "required: an interface name"
	case len(n) > MaxInterfaceNameLen:
		return fmt.Sprintf("%q is longer than %d characters", n, MaxInterfaceNameLen)
	case n == "." || n == "..":
		return fmt.Sprintf("%q is not an interface name", n)
	}
	for _, r := range n {
		if r == '/' || r == ':' || r <= ' ' || r == 0x7f {
			return fmt.Sprintf("%q has a character not allowed in an interface name ('/', ':', white space or a control character)", n)
		}
	}
	return ""
}

// nodeNameProblem says what is wrong with node_name, or "".
func nodeNameProblem(n string) string {
	if len(n) > MaxNodeNameLen {
		return fmt.Sprintf("longer than %d characters", MaxNodeNameLen)
	}
	for _, r := range n {
		if r <= ' ' || r >= 0x7f {
			return fmt.Sprintf("%q has a character other than printable ASCII without white space", n)
		}
	}
	return ""
}

func vmIDProblem(id string) string {
	switch {
	case id == "":
		return "required: the VM's id"
	case len(id) > MaxVMIDLen:
		return fmt.Sprintf("longer than %d characters", MaxVMIDLen)
	}
	for _, r := range id {
		if r <= ' ' || r >= 0x7f || r == '/' {
			return fmt.Sprintf("%q has a character other than printable ASCII without '/' and white space", id)
		}
	}
	return ""
}

// Tier returns map_tier as a bpf.Tier, or 0 if it is not valid (Validate
// reports that).
func (c *Config) Tier() bpf.Tier {
	t, err := bpf.ParseTier(c.MapTier)
	if err != nil {
		return 0
	}
	return t
}

// LoaderOptions returns the options for bpf.Open.
func (c *Config) LoaderOptions() bpf.Options {
	return bpf.Options{
		PinRoot:    c.PinRoot,
		Tier:       c.Tier(),
		ObjectDir:  c.ObjectDir,
		HashSeed:   c.HashSeed,
		AttachMode: c.AttachMode,
		// A node configured from a file is the machine's owner (the
		// reference daemon): it mounts bpffs if the machine has none.
		MountBPFFS: true,
	}
}

// ConntrackTimeouts returns the conntrack timeouts, for conntrack.Config
// and for the meta map (conntrack.Timeouts.ApplyTo).
func (c *Config) ConntrackTimeouts() conntrack.Timeouts {
	return conntrack.Timeouts{
		TCPSyn:         c.TCPSynTimeout.Duration,
		TCPEstablished: c.TCPEstablishedTimeout.Duration,
		TCPFin:         c.TCPFinTimeout.Duration,
		TCPRst:         c.TCPRstTimeout.Duration,
		UDP:            c.UDPTimeout.Duration,
	}
}
