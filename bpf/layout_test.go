package bpf

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"
)

// TestLayoutsMatchBTF compares every Go mirror with the struct of the same
// name in the object's BTF: total size, and the name, offset and size of
// each field. The C side asserts the sizes with _Static_assert too, so a
// layout can change on neither side alone.
func TestLayoutsMatchBTF(t *testing.T) {
	spec, err := loadService()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		cname string
		size  uint32
		goVal any
	}{
		{"fluxvm_svc4_key", 8, SvcKey4{}},
		{"fluxvm_svc6_key", 20, SvcKey6{}},
		{"fluxvm_svc_value", 24, SvcValue{}},
		{"fluxvm_fe4_slot", 24, Fe4Slot{}},
		{"fluxvm_guard", 8, Guard{}},
		{"fluxvm_backend", 32, Backend{}},
		{"fluxvm_tuple4", 16, Tuple4{}},
		{"fluxvm_tuple6", 40, Tuple6{}},
		{"fluxvm_ct_value", 64, CTValue{}},
		{"fluxvm_nat_value", 64, NATValue{}},
		{"fluxvm_svc_stats_value", 96, ServiceStats{}},
		{"fluxvm_meta_value", 48, Meta{}},
		{"fluxvm_edge_slot", 8, EdgeSlot{}},
		{"fluxvm_snat_cfg", 32, SNATConfig{}},
		{"fluxvm_snat_peer_key", 20, SNATPeerKey{}},
		{"fluxvm_snat_peer_value", 8, SNATPeerValue{}},
		{"fluxvm_be2fe_key", 20, Be2feKey{}},
		{"fluxvm_be2fe_slot", 28, Be2feSlot{}},
		{"fluxvm_be2fe_value", 116, Be2feValue{}},
		{"fluxvm_sock_key", 32, SockKey{}},
		{"fluxvm_sock_value", 8, SockValue{}},
		{"fluxvm_sock_rkey", 32, SockRevKey{}},
		{"fluxvm_sock_rvalue", 32, SockRevValue{}},
		{"fluxvm_sid4_key", 8, SIDKey4{}},
		{"fluxvm_sid6_key", 20, SIDKey6{}},
		{"fluxvm_sid_value", 8, SIDValue{}},
		{"fluxvm_spol_key", 8, PolicyKey{}},
		{"fluxvm_spol_value", 16, PolicyValue{}},
		{"fluxvm_ha_record", 128, HARecord{}},
	}
	for _, tt := range tests {
		t.Run(tt.cname, func(t *testing.T) {
			var st *btf.Struct
			if err := spec.Types.TypeByName(tt.cname, &st); err != nil {
				t.Fatalf("not in BTF: %v", err)
			}
			gt := reflect.TypeOf(tt.goVal)
			if st.Size != tt.size || uintptr(st.Size) != gt.Size() {
				t.Fatalf("size: C %d, Go %d, want %d", st.Size, gt.Size(), tt.size)
			}
			var fields []reflect.StructField
			for i := range gt.NumField() {
				if f := gt.Field(i); f.Name != "_" {
					fields = append(fields, f)
				}
			}
			if len(fields) != len(st.Members) {
				t.Fatalf("C has %d fields, Go %d", len(st.Members), len(fields))
			}
			for i, m := range st.Members {
				f := fields[i]
				name := m.Name
				// An anonymous union is one Go field named by its first
				// member (bpf2go); every member must span the whole
				// union, so that the field holds each of them.
				if u, ok := m.Type.(*btf.Union); ok && name == "" {
					name = u.Members[0].Name
					for _, um := range u.Members {
						if sz, err := btf.Sizeof(um.Type); err != nil || uint32(sz) != u.Size || um.Offset != 0 {
							t.Errorf("union member %s of field %d: size %d at bit %d, want the union's %d at 0 (%v)",
								um.Name, i, sz, um.Offset, u.Size, err)
						}
					}
				}
				if !strings.EqualFold(strings.ReplaceAll(name, "_", ""), f.Name) {
					t.Errorf("field %d: C %s, Go %s", i, name, f.Name)
				}
				if uint32(m.Offset.Bytes()) != uint32(f.Offset) {
					t.Errorf("%s: C offset %d, Go %d", m.Name, m.Offset.Bytes(), f.Offset)
				}
				sz, err := btf.Sizeof(m.Type)
				if err != nil {
					t.Fatal(err)
				}
				if uintptr(sz) != f.Type.Size() {
					t.Errorf("%s: C size %d, Go %d", m.Name, sz, f.Type.Size())
				}
			}
		})
	}
}

func TestAddrWordsRoundTrip(t *testing.T) {
	for _, s := range []string{"10.1.2.3", "::ffff:10.1.2.3", "fd00::1", "2001:db8::ff:1"} {
		a := netip.MustParseAddr(s)
		fam := uint8(FamilyIPv6)
		if a.Is4() || a.Is4In6() {
			fam = FamilyIPv4
		}
		if got := Addr(AddrWords(a), fam); got != a.Unmap() {
			t.Errorf("%s: round trip gave %s", s, got)
		}
	}
	if Port(Port(8080)) != 8080 {
		t.Error("Port is not its own inverse")
	}
}
