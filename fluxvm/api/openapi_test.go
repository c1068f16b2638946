package api

import (
	"bufio"
	"net/http"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/fluxvm/servicefabric/advert"
	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/conntrack"
	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/flows/otlp"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/ha"
)

const openAPIPath = "../../docs/openapi.yaml"

// openAPIDoc is what the tests read from docs/openapi.yaml. The file is
// indented with two spaces per level, which lets a line-based reader find
// the keys below without a YAML library.
type openAPIDoc struct {
	ops        map[string]string   // "GET /path" -> x-fluxvm-access
	schemas    map[string][]string // schema -> property names
	errorCodes []string            // ErrorCode enum
}

var (
	rePath     = regexp.MustCompile(`^  (/[^:\s]*):\s*$`)
	reMethod   = regexp.MustCompile(`^    (get|put|post|delete|patch|head|options|trace):\s*$`)
	reAccess   = regexp.MustCompile(`^      x-fluxvm-access:\s*(\S+)\s*$`)
	reSection  = regexp.MustCompile(`^(\S[^:]*):`)
	reSub      = regexp.MustCompile(`^  ([A-Za-z]\w*):\s*$`)
	reSchema   = regexp.MustCompile(`^    ([A-Za-z]\w*):\s*$`)
	reProps    = regexp.MustCompile(`^      properties:`)
	reSchemaKV = regexp.MustCompile(`^      \S`)
	reProp     = regexp.MustCompile(`^        ([a-z_0-9]+):`)
	reEnum     = regexp.MustCompile(`^      enum:\s*$`)
	reEnumItem = regexp.MustCompile(`^        - (\S+)\s*$`)
)

func readOpenAPI(t *testing.T) openAPIDoc {
	t.Helper()
	f, err := os.Open(openAPIPath)
	if err != nil {
		t.Fatalf("open the OpenAPI document: %v", err)
	}
	defer f.Close()
	doc := openAPIDoc{ops: map[string]string{}, schemas: map[string][]string{}}
	var section, sub, path, op, schema string
	var inProps, inEnum bool
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.TrimSpace(line) == "" || strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		if m := reSection.FindStringSubmatch(line); m != nil {
			section, sub, path, op, schema = m[1], "", "", "", ""
			continue
		}
		switch section {
		case "paths":
			if m := rePath.FindStringSubmatch(line); m != nil {
				path, op = m[1], ""
			} else if m := reMethod.FindStringSubmatch(line); m != nil && path != "" {
				op = strings.ToUpper(m[1]) + " " + path
				if _, dup := doc.ops[op]; dup {
					t.Errorf("OpenAPI: %s twice", op)
				}
				doc.ops[op] = ""
			} else if m := reAccess.FindStringSubmatch(line); m != nil && op != "" {
				doc.ops[op] = m[1]
			}
		case "components":
			if m := reSub.FindStringSubmatch(line); m != nil {
				sub, schema = m[1], ""
				continue
			}
			if sub != "schemas" {
				continue
			}
			if m := reSchema.FindStringSubmatch(line); m != nil {
				schema, inProps, inEnum = m[1], false, false
				if _, dup := doc.schemas[schema]; dup {
					t.Errorf("OpenAPI: schema %s twice", schema)
				}
				doc.schemas[schema] = []string{}
				continue
			}
			switch {
			case reProps.MatchString(line):
				inProps, inEnum = true, false
			case reEnum.MatchString(line):
				inProps, inEnum = false, true
			case reSchemaKV.MatchString(line):
				inProps, inEnum = false, false
			case inProps:
				if m := reProp.FindStringSubmatch(line); m != nil {
					doc.schemas[schema] = append(doc.schemas[schema], m[1])
				}
			case inEnum && schema == "ErrorCode":
				if m := reEnumItem.FindStringSubmatch(line); m != nil {
					doc.errorCodes = append(doc.errorCodes, m[1])
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("read the OpenAPI document: %v", err)
	}
	return doc
}

// TestOpenAPIRoutes checks that the document and the route table list the
// same operations with the same access level.
func TestOpenAPIRoutes(t *testing.T) {
	doc := readOpenAPI(t)
	if len(doc.ops) == 0 {
		t.Fatal("no operations found under paths:")
	}
	inTable := map[string]bool{}
	for _, rt := range routes {
		key := rt.pattern()
		inTable[key] = true
		access, ok := doc.ops[key]
		if !ok {
			t.Errorf("route %s is not in %s", key, openAPIPath)
			continue
		}
		want := "read"
		if rt.admin {
			want = "admin"
		}
		if access != want {
			t.Errorf("%s: x-fluxvm-access %q in the document, the handler needs %q", key, access, want)
		}
	}
	for key := range doc.ops {
		if !inTable[key] {
			t.Errorf("%s documents %s, which the handler does not serve", openAPIPath, key)
		}
	}
}

// TestOpenAPISchemas checks the documented properties of every schema
// against the JSON names of the Go type it describes, both ways.
func TestOpenAPISchemas(t *testing.T) {
	doc := readOpenAPI(t)
	types := map[string]reflect.Type{
		"Service":                reflect.TypeFor[fluxvm.Service](),
		"ServicePort":            reflect.TypeFor[fluxvm.ServicePort](),
		"Backend":                reflect.TypeFor[fluxvm.Backend](),
		"HealthCheck":            reflect.TypeFor[fluxvm.HealthCheck](),
		"ServiceStatus":          reflect.TypeFor[fluxvm.ServiceStatus](),
		"FrontendStatus":         reflect.TypeFor[fluxvm.FrontendStatus](),
		"ServiceEDTStatus":       reflect.TypeFor[fluxvm.ServiceEDTStatus](),
		"EDTStatus":              reflect.TypeFor[fluxvm.EDTStatus](),
		"EDTInterfaceStatus":     reflect.TypeFor[fluxvm.EDTInterfaceStatus](),
		"Status":                 reflect.TypeFor[fluxvm.Status](),
		"Capacities":             reflect.TypeFor[fluxvm.Capacities](),
		"LoadStatus":             reflect.TypeFor[fluxvm.LoadStatus](),
		"InterfaceStatus":        reflect.TypeFor[fluxvm.InterfaceStatus](),
		"HookStatus":             reflect.TypeFor[fluxvm.HookStatus](),
		"SNATStatus":             reflect.TypeFor[fluxvm.SNATStatus](),
		"XDPRouteCacheStatus":    reflect.TypeFor[fluxvm.XDPRouteCacheStatus](),
		"FrontendIndexStatus":    reflect.TypeFor[bpf.FrontendIndexStats](),
		"ProgrammedStatus":       reflect.TypeFor[fluxvm.ProgrammedStatus](),
		"IDPoolStats":            reflect.TypeFor[fluxvm.IDPoolStats](),
		"SocketLBStatus":         reflect.TypeFor[fluxvm.SocketLBStatus](),
		"SocketDestroyStatus":    reflect.TypeFor[fluxvm.SocketDestroyStatus](),
		"SeedStatus":             reflect.TypeFor[fluxvm.SeedStatus](),
		"MemoryStatus":           reflect.TypeFor[fluxvm.MemoryStatus](),
		"MapSizesStatus":         reflect.TypeFor[fluxvm.MapSizesStatus](),
		"MapSizeStatus":          reflect.TypeFor[fluxvm.MapSizeStatus](),
		"MapGrowth":              reflect.TypeFor[fluxvm.MapGrowth](),
		"InnerMapsMemory":        reflect.TypeFor[fluxvm.InnerMapsMemory](),
		"Counters":               reflect.TypeFor[fluxvm.Counters](),
		"Stats":                  reflect.TypeFor[fluxvm.Stats](),
		"VMStats":                reflect.TypeFor[fluxvm.VMStats](),
		"GCResult":               reflect.TypeFor[fluxvm.GCResult](),
		"PressureStatus":         reflect.TypeFor[fluxvm.PressureStatus](),
		"MapPressure":            reflect.TypeFor[fluxvm.MapPressure](),
		"PressureRound":          reflect.TypeFor[fluxvm.PressureRound](),
		"PressureCompaction":     reflect.TypeFor[fluxvm.PressureCompaction](),
		"FlowMapCompaction":      reflect.TypeFor[bpf.FlowMapCompaction](),
		"ShedCounts":             reflect.TypeFor[conntrack.ShedCounts](),
		"GCRequest":              reflect.TypeFor[gcRequest](),
		"HealthReconcileRequest": reflect.TypeFor[reconcileRequest](),
		"SNATPeersRequest":       reflect.TypeFor[snatPeersRequest](),
		"HealthReport":           reflect.TypeFor[fluxvm.HealthReport](),
		"ServiceHealth":          reflect.TypeFor[fluxvm.ServiceHealth](),
		"BackendHealth":          reflect.TypeFor[fluxvm.BackendHealth](),
		"AdvertisementStatus":    reflect.TypeFor[fluxvm.AdvertisementStatus](),
		"AdvertisementSnapshot":  reflect.TypeFor[advert.Snapshot](),
		"AdvertisementEntry":     reflect.TypeFor[advert.Entry](),
		"AdvertisementPort":      reflect.TypeFor[advert.Port](),
		"FlowsResponse":          reflect.TypeFor[FlowsResponse](),
		"FlowRecord":             reflect.TypeFor[flows.Record](),
		"FlowCounts":             reflect.TypeFor[flows.Counts](),
		"ExportResponse":         reflect.TypeFor[ExportResponse](),
		"OTLPExportReport":       reflect.TypeFor[otlp.Report](),
		"Policy":                 reflect.TypeFor[fluxvm.Policy](),
		"L7Policy":               reflect.TypeFor[fluxvm.L7Policy](),
		"PolicyReconcileRequest": reflect.TypeFor[policyReconcileRequest](),
		"PoliciesStatus":         reflect.TypeFor[fluxvm.PoliciesStatus](),
		"PolicyStatus":           reflect.TypeFor[fluxvm.PolicyStatus](),
		"EnvoyDocument":          reflect.TypeFor[fluxvm.EnvoyDocument](),
		"PolicyCounters":         reflect.TypeFor[fluxvm.PolicyCounters](),
		"PolicyServiceCounters":  reflect.TypeFor[fluxvm.PolicyServiceCounters](),
		"IPCache":                reflect.TypeFor[fluxvm.IPCache](),
		"IPCacheEntry":           reflect.TypeFor[fluxvm.IPCacheEntry](),
		"HAStatus":               reflect.TypeFor[fluxvm.HAStatus](),
		"HAQueueStatus":          reflect.TypeFor[fluxvm.HAQueueStatus](),
		"HALease":                reflect.TypeFor[fluxvm.HALease](),
		"HADeltaResult":          reflect.TypeFor[fluxvm.HADeltaResult](),
		"DeltaAckRequest":        reflect.TypeFor[DeltaAckRequest](),
		"Delta":                  reflect.TypeFor[ha.Delta](),
		"Batch":                  reflect.TypeFor[ha.Batch](),
		"Op":                     reflect.TypeFor[ha.Op](),
		"ConntrackKey":           reflect.TypeFor[conntrack.Key](),
		"Flow":                   reflect.TypeFor[ha.Flow](),
		"NATHalf":                reflect.TypeFor[ha.NATHalf](),
		"Cursor":                 reflect.TypeFor[ha.Cursor](),
		"JournalStats":           reflect.TypeFor[ha.JournalStats](),
		"SnapshotHeader":         reflect.TypeFor[ha.Header](),
		"ImportResult":           reflect.TypeFor[ha.ImportResult](),
		"ExportResult":           reflect.TypeFor[ha.ExportResult](),
		"Error":                  reflect.TypeFor[ErrorResponse](),
		"ErrorDetail":            reflect.TypeFor[ErrorDetail](),
	}
	notStructs := map[string]bool{"ErrorCode": true}
	for name := range doc.schemas {
		if _, ok := types[name]; !ok && !notStructs[name] {
			t.Errorf("schema %s describes no known Go type", name)
		}
	}
	for name, typ := range types {
		props, ok := doc.schemas[name]
		if !ok {
			t.Errorf("schema %s (%s) is missing", name, typ)
			continue
		}
		want := jsonNames(typ)
		sort.Strings(props)
		if !slices.Equal(props, want) {
			t.Errorf("schema %s has properties %v, %s has JSON fields %v", name, props, typ, want)
		}
	}
}

// jsonNames returns the sorted JSON field names of a struct type.
func jsonNames(t reflect.Type) []string {
	names := []string{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch name {
		case "-":
			continue
		case "":
			name = f.Name
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

// TestOpenAPIErrorCodes checks the ErrorCode enum against the codes the
// handler sends, and the error table in the description.
func TestOpenAPIErrorCodes(t *testing.T) {
	doc := readOpenAPI(t)
	want := make([]string, len(allCodes))
	for i, c := range allCodes {
		want[i] = string(c)
	}
	if !slices.Equal(doc.errorCodes, want) {
		t.Errorf("ErrorCode enum %v, handler codes %v", doc.errorCodes, want)
	}
	raw, err := os.ReadFile(openAPIPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range allCodes {
		row := "| " + string(c) + " | " + strconv.Itoa(c.Status()) + " |"
		if !strings.Contains(string(raw), row) {
			t.Errorf("error table lacks the row %q", row)
		}
	}
}

// TestRouteTable checks the invariants of the route table: mutations need
// admin, reads do not, only POST routes read a body, no route twice.
func TestRouteTable(t *testing.T) {
	seen := map[string]bool{}
	for _, rt := range routes {
		if seen[rt.pattern()] {
			t.Errorf("route %s twice", rt.pattern())
		}
		seen[rt.pattern()] = true
		mutation := rt.method != http.MethodGet
		if rt.admin != mutation {
			t.Errorf("%s: admin = %v, want %v", rt.pattern(), rt.admin, mutation)
		}
		if rt.body && rt.method != http.MethodPost {
			t.Errorf("%s reads a body but is not a POST", rt.pattern())
		}
		if rt.handle == nil {
			t.Errorf("%s has no handler", rt.pattern())
		}
	}
}

// TestOpenAPIReservedNames checks that the document's list of reserved
// names is fluxvm.ReservedNames, and that every literal segment under
// /v1/network/services/ of the route table is reserved.
func TestOpenAPIReservedNames(t *testing.T) {
	raw, err := os.ReadFile(openAPIPath)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(raw), "## Reserved names")
	if !ok {
		t.Fatal("no Reserved names section")
	}
	section, _, _ = strings.Cut(section, "\n    ## ")
	var listed []string
	for _, m := range regexp.MustCompile("`([a-z]+)`").FindAllStringSubmatch(section, -1) {
		listed = append(listed, m[1])
	}
	if want := fluxvm.ReservedNames(); !slices.Equal(listed, want) {
		t.Errorf("Reserved names section lists %v, want %v", listed, want)
	}
	const prefix = "/v1/network/services/"
	for _, rt := range routes {
		seg, _, _ := strings.Cut(strings.TrimPrefix(rt.path, prefix), "/")
		if strings.HasPrefix(rt.path, prefix) && !strings.HasPrefix(seg, "{") && !fluxvm.IsReservedName(seg) {
			t.Errorf("route %s: segment %q is not a reserved name", rt.pattern(), seg)
		}
	}
}
