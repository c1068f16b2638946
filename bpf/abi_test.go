package bpf

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// TestCounterABI checks the Go Counter names against the enum in the
// object's BTF, so a counter added in C without its Go name (or renumbered)
// fails here rather than being misreported.
func TestCounterABI(t *testing.T) {
	spec, err := loadService()
	if err != nil {
		t.Fatal(err)
	}
	checkEnum(t, spec, "fluxvm_counter", "FLUXVM_CNT_", NumCounters, func(v uint64) string { return Counter(v).String() })
	checkEnum(t, spec, "fluxvm_drop_reason", "FLUXVM_DROP_", NumDropReasons, func(v uint64) string { return DropReason(v).String() })

	for name, n := range map[string]int{"fluxvm_counters": NumCounters, "fluxvm_drops": NumDropReasons} {
		m := spec.Maps[name]
		if m == nil {
			t.Fatalf("no %s map in the object", name)
		}
		if m.Type != ebpf.PerCPUArray || m.KeySize != 4 || m.ValueSize != 8 || int(m.MaxEntries) != n {
			t.Errorf("%s = %v key %d value %d entries %d; want per-CPU array, 4, 8, %d",
				name, m.Type, m.KeySize, m.ValueSize, m.MaxEntries, n)
		}
	}
}

// checkEnum requires a Go name for every value of the C enum, equal to the
// C name without prefix in lower case, and the MAX value to equal n.
func checkEnum(t *testing.T, spec *ebpf.CollectionSpec, cname, prefix string, n int, goName func(uint64) string) {
	t.Helper()
	var enum *btf.Enum
	if err := spec.Types.TypeByName(cname, &enum); err != nil {
		t.Fatalf("%s not in BTF: %v", cname, err)
	}
	seen := 0
	for _, v := range enum.Values {
		if v.Name == prefix+"MAX" {
			if int(v.Value) != n {
				t.Errorf("%sMAX = %d, Go has %d", prefix, v.Value, n)
			}
			continue
		}
		seen++
		want := strings.ToLower(strings.TrimPrefix(v.Name, prefix))
		if got := goName(v.Value); got != want {
			t.Errorf("%s (%d): Go name %q, want %q", v.Name, v.Value, got, want)
		}
	}
	if seen != n {
		t.Errorf("%s: BTF has %d values, Go has %d", cname, seen, n)
	}
}

func TestCounterString(t *testing.T) {
	if got := CounterTruncated.String(); got != "truncated" {
		t.Errorf("CounterTruncated = %q", got)
	}
	if got := Counter(999).String(); got != "counter(999)" {
		t.Errorf("unknown counter = %q", got)
	}
}

// goEnums names the exported Go constant of every member of every C enum in
// the object's BTF (the counter and drop-reason enums have TestCounterABI).
// The Go constants are the bpf2go-generated ones under their API names, so
// their values cannot drift; this table makes a C member that has no Go
// name yet, or a new C enum, fail instead of going unnoticed.
var goEnums = map[string]map[string]uint64{
	"fluxvm_abi_const": {
		"FLUXVM_SCHEMA_VERSION": uint64(SchemaVersion),
		"FLUXVM_SNAT_TRIES":     uint64(SNATTries),
		"FLUXVM_EDGE_SLOT_MASK": uint64(EdgeSlotMask),
		"FLUXVM_BE2FE_SLOTS":    uint64(Be2feSlots),
		"FLUXVM_SNAT_PEERS_MAX": uint64(SNATPeersMax),
	},
	"fluxvm_family": {"FLUXVM_AF_INET": uint64(FamilyIPv4), "FLUXVM_AF_INET6": uint64(FamilyIPv6)},
	"fluxvm_svc_flags": {
		"FLUXVM_SVC_F_VIP_MARKER":   uint64(SvcFlagVIPMarker),
		"FLUXVM_SVC_F_NORTH_SOUTH":  uint64(SvcFlagNorthSouth),
		"FLUXVM_SVC_F_NO_EAST_WEST": uint64(SvcFlagNoEastWest),
		"FLUXVM_SVC_F_DSR":          uint64(SvcFlagDSR),
		"FLUXVM_SVC_F_HOST_ROUTING": uint64(SvcFlagHostRouting),
		"FLUXVM_SVC_F_REV_STORED":   uint64(SvcFlagRevStored),
		"FLUXVM_SVC_F_PACED":        uint64(SvcFlagPaced),
		"FLUXVM_SVC_F_POLICY":       uint64(SvcFlagPolicy),
		"FLUXVM_SVC_F_L7":           uint64(SvcFlagL7),
	},
	"fluxvm_spol_const":    {"FLUXVM_SPOL_HEADER": uint64(PolicyHeader)},
	"fluxvm_policy_action": {"FLUXVM_POLICY_ALLOW": uint64(PolicyAllow), "FLUXVM_POLICY_DENY": uint64(PolicyDeny)},
	"fluxvm_policy_flags":  {"FLUXVM_POLICY_F_AUDIT": uint64(PolicyFlagAudit), "FLUXVM_POLICY_F_L7": uint64(PolicyFlagL7)},
	"fluxvm_meta_flags":    {"FLUXVM_META_F_HA": uint64(MetaFlagHA)},
	"fluxvm_ha_op":         {"FLUXVM_HA_UPSERT": uint64(HAUpsert)},
	"fluxvm_ha_cause": {
		"FLUXVM_HA_NEW": uint64(HANew), "FLUXVM_HA_TRANSITION": uint64(HATransition),
		"FLUXVM_HA_REFRESH": uint64(HARefresh),
	},
	"fluxvm_flow_verdict": {
		"FLUXVM_FLOW_FORWARDED": uint64(FlowForwarded), "FLUXVM_FLOW_DROPPED": uint64(FlowDropped),
		"FLUXVM_FLOW_AUDITED": uint64(FlowAudited), "FLUXVM_FLOW_REDIRECTED": uint64(FlowRedirected),
	},
	"fluxvm_flow_hook": {
		"FLUXVM_HOOK_FROM_VM": uint64(FlowHookFromVM), "FLUXVM_HOOK_TO_VM": uint64(FlowHookToVM),
		"FLUXVM_HOOK_NS_IN": uint64(FlowHookNSIn), "FLUXVM_HOOK_NS_OUT": uint64(FlowHookNSOut),
		"FLUXVM_HOOK_XDP": uint64(FlowHookXDP),
	},
	"fluxvm_fe_state": {
		"FLUXVM_FE_UNKNOWN": uint64(FeUnknown), "FLUXVM_FE_EMPTY": uint64(FeEmpty),
		"FLUXVM_FE_ONE": uint64(FeOne), "FLUXVM_FE_SHARED": uint64(FeShared),
	},
	"fluxvm_guard_state": {"FLUXVM_GUARD_CLOSED": uint64(GuardClosed), "FLUXVM_GUARD_OPEN": uint64(GuardOpen)},
	"fluxvm_backend_state": {
		"FLUXVM_BE_UNUSED":    uint64(BackendUnused),
		"FLUXVM_BE_READY":     uint64(BackendReady),
		"FLUXVM_BE_DRAINING":  uint64(BackendDraining),
		"FLUXVM_BE_UNHEALTHY": uint64(BackendUnhealthy),
	},
	"fluxvm_ct_state": {
		"FLUXVM_CT_NONE":            uint64(CTNone),
		"FLUXVM_CT_TCP_SYN":         uint64(CTTCPSyn),
		"FLUXVM_CT_TCP_ESTABLISHED": uint64(CTTCPEstablished),
		"FLUXVM_CT_TCP_FIN":         uint64(CTTCPFin),
		"FLUXVM_CT_TCP_RST":         uint64(CTTCPRst),
		"FLUXVM_CT_UDP":             uint64(CTUDP),
	},
	"fluxvm_ct_flags": {"FLUXVM_CT_F_SNAT": uint64(CTFlagSNAT), "FLUXVM_CT_F_DSR": uint64(CTFlagDSR),
		"FLUXVM_CT_F_REV_DERIVED": uint64(CTFlagRevDerived), "FLUXVM_CT_F_AUDITED": uint64(CTFlagAudited),
		"FLUXVM_CT_F_L7": uint64(CTFlagL7)},
	"fluxvm_be2fe_flags":     {"FLUXVM_BE2FE_F_OVERFLOW": uint64(Be2feFlagOverflow)},
	"fluxvm_nat_flags":       {"FLUXVM_NAT_F_SNAT": uint64(NATFlagSNAT), "FLUXVM_NAT_F_HOST_ROUTING": uint64(NATFlagHostRouting)},
	"fluxvm_snat_flags":      {"FLUXVM_SNAT_F_V4": uint64(SNATFlagV4), "FLUXVM_SNAT_F_V6": uint64(SNATFlagV6), "FLUXVM_SNAT_F_PEERS": uint64(SNATFlagPeers)},
	"fluxvm_snat_peer_flags": {"FLUXVM_SNAT_PEER_F_ANNOUNCE": uint64(SNATPeerFlagAnnounce)},
	"fluxvm_timeout_default": {
		"FLUXVM_TIMEOUT_TCP_SYN_S":         uint64(DefaultTimeoutTCPSyn),
		"FLUXVM_TIMEOUT_TCP_ESTABLISHED_S": uint64(DefaultTimeoutTCPEstablished),
		"FLUXVM_TIMEOUT_TCP_FIN_S":         uint64(DefaultTimeoutTCPFin),
		"FLUXVM_TIMEOUT_TCP_RST_S":         uint64(DefaultTimeoutTCPRst),
		"FLUXVM_TIMEOUT_UDP_S":             uint64(DefaultTimeoutUDP),
	},
	// The tier the object was built for; checked per tier object below,
	// since Tier stays hand-written (FLUXVM_TIER_* serve #if in C).
	"fluxvm_built_tier": {"FLUXVM_BUILT_TIER": uint64(TierM)},
}

// TestEnumsMatchBTF walks every fluxvm_ enum in the object's BTF and
// requires, for each member, a Go constant of the same value in goEnums,
// and for each enum a -type in gen.go (so bpf2go generates it), and no Go
// constant without its C member.
func TestEnumsMatchBTF(t *testing.T) {
	spec, err := loadService()
	if err != nil {
		t.Fatal(err)
	}
	gen, err := os.ReadFile("gen.go")
	if err != nil {
		t.Fatal(err)
	}
	typed := map[string]bool{}
	for _, m := range regexp.MustCompile(`-type (\S+)`).FindAllStringSubmatch(string(gen), -1) {
		typed[m[1]] = true
	}
	seen := map[string]bool{}
	for typ, err := range spec.Types.All() {
		if err != nil {
			t.Fatal(err)
		}
		enum, ok := typ.(*btf.Enum)
		if !ok || !strings.HasPrefix(enum.Name, "fluxvm_") {
			continue
		}
		seen[enum.Name] = true
		if !typed[enum.Name] {
			t.Errorf("enum %s: not generated; add -type %s to the bpf2go line in gen.go", enum.Name, enum.Name)
		}
		if enum.Name == "fluxvm_counter" || enum.Name == "fluxvm_drop_reason" {
			continue // TestCounterABI
		}
		want, ok := goEnums[enum.Name]
		if !ok {
			t.Errorf("enum %s has no Go constants: name each member in layout.go (from the generated constants) and add them to goEnums", enum.Name)
			continue
		}
		members := map[string]bool{}
		for _, v := range enum.Values {
			members[v.Name] = true
			got, ok := want[v.Name]
			switch {
			case !ok:
				t.Errorf("%s.%s = %d has no Go constant: add one in layout.go (from the generated constant) and to goEnums", enum.Name, v.Name, v.Value)
			case got != v.Value:
				t.Errorf("%s.%s = %d in C, %d in Go", enum.Name, v.Name, v.Value, got)
			}
		}
		for name := range want {
			if !members[name] {
				t.Errorf("goEnums has %s.%s, which the C enum does not", enum.Name, name)
			}
		}
	}
	for name := range goEnums {
		if !seen[name] {
			t.Errorf("goEnums has enum %s, which the object's BTF does not (is it in struct fluxvm_abi_enums?)", name)
		}
	}

	// Every state has a name of its own.
	for _, s := range []BackendState{BackendUnused, BackendReady, BackendDraining, BackendUnhealthy} {
		if strings.Contains(s.String(), "(") {
			t.Errorf("BackendState %d has no name", s)
		}
	}
	for _, s := range []CTState{CTNone, CTTCPSyn, CTTCPEstablished, CTTCPFin, CTTCPRst, CTUDP} {
		if strings.Contains(s.String(), "(") {
			t.Errorf("CTState %d has no name", s)
		}
	}
}

// TestTierMatchesObject checks the hand-written Tier values (C keeps the
// tiers as #defines, which #if needs) against FLUXVM_BUILT_TIER in the BTF
// of each tier's object.
func TestTierMatchesObject(t *testing.T) {
	for _, tier := range []Tier{TierS, TierM, TierL} {
		spec, err := Spec(tier)
		if err != nil {
			t.Fatal(err)
		}
		var enum *btf.Enum
		if err := spec.Types.TypeByName("fluxvm_built_tier", &enum); err != nil {
			t.Fatalf("tier %s: %v", tier, err)
		}
		if len(enum.Values) != 1 || enum.Values[0].Value != uint64(tier) {
			t.Errorf("tier %s (%d): the object says it was built for %v", tier, uint8(tier), enum.Values)
		}
	}
}
