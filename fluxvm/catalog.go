package fluxvm

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"time"
)

// catalogVersion is the format of the node-local catalog file.
const catalogVersion = 1

// catalogFile is the node-local copy of Fabric's intent, with the datapath
// ids each frontend and backend was given, so that a restarted node keeps
// the ids its conntrack entries name and established flows stay put.
//
// Seq is the sequence number of the last journal record the file
// includes (journal.go); a file without it includes none.
type catalogFile struct {
	Version  int              `json:"version"`
	Seq      uint64           `json:"journal_seq,omitempty"`
	Services []catalogService `json:"services"`
	// Policies is the identity policy state (policy.go): the ipcache and
	// the services' policies; nil: none was ever set.
	Policies *catalogPolicies `json:"policies,omitempty"`
}

// catalogPolicies is what the identity policies are compiled from, as
// the last reconcile applied it.
type catalogPolicies struct {
	IPCache  IPCache  `json:"ipcache"`
	Policies []Policy `json:"policies"`
	// IDs are the policies' datapath ids by service: kept across a
	// restart, so that the rule sets the kept maps hold stay their
	// policies' until the restore has written every header.
	IDs map[string]uint32 `json:"ids,omitempty"`
}

type catalogService struct {
	Service   Service           `json:"service"`
	Revision  uint64            `json:"revision"`
	AppliedAt time.Time         `json:"applied_at"`
	Frontends []catalogFrontend `json:"frontends"`
}

type catalogFrontend struct {
	VIP       netip.Addr       `json:"vip"`
	Port      uint16           `json:"port"`
	Protocol  Protocol         `json:"protocol"`
	ServiceID uint32           `json:"service_id"`
	Backends  []catalogBackend `json:"backends"`
}

type catalogBackend struct {
	Endpoint  netip.AddrPort `json:"endpoint"`
	BackendID uint32         `json:"backend_id"`
}

func readCatalog(path string) (catalogFile, error) {
	var c catalogFile
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return catalogFile{Version: catalogVersion}, nil
	}
	if err != nil {
		return c, fmt.Errorf("fluxvm: catalog: %w", err)
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return c, fmt.Errorf("fluxvm: catalog %s: %w", path, err)
	}
	if c.Version != catalogVersion {
		return c, fmt.Errorf("fluxvm: catalog %s: version %d, want %d", path, c.Version, catalogVersion)
	}
	return c, nil
}
