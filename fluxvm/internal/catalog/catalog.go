// Package catalog persists the node-local catalog of a dataplane: the
// services' intents with the datapath ids they were given, and the
// identity policy state, so that a restarted node restores them (with
// the same ids: its conntrack entries name them).
//
// What it owns: the catalog file (the snapshot, File), the journal files
// next to it (the changes since, one Record each, with group commit),
// the compactions that turn the journal into a new snapshot, and the
// catalog's lock file (Lock). The on-disk format is described below and
// in docs/architecture.md ("Catalog persistence").
//
// Its lock: a Store has its own mutex, guarding only the journal's
// state. The dataplane (the façade, package fluxvm) appends the records
// under its own lock, so that their order is the order of the changes,
// and may hold it while it calls into the Store (Append, CatchUp): the
// Store's lock is always taken after the façade's, never before. The
// Store never calls back into the façade while holding its own lock: a
// compaction calls Deps.Snapshot with no lock of the Store held; the
// façade takes its own lock in there, captures the state and calls cut
// (which takes the Store's lock briefly, to switch the journal to the
// next file), and lets its lock go before it returns. The snapshot is
// then written with neither lock held, while changes keep being appended
// to the next journal file.
//
// Its deps: Deps.Snapshot, the state of the catalog as the façade has
// it.
//
// # Format
//
// The snapshot is the catalog file (Config.Path, format File, written
// atomically by atomicfile.Write). Its journal_seq is the sequence number
// of the last change it includes (0, or absent, in a catalog written
// before the journal existed).
//
// The journal holds the changes since, one record per change (an apply
// or delete of a service, or the identity policy state), appended to
// Path.journal.<generation> (the generation is a decimal number; a
// compaction starts the next one). A record is
//
//	magic   uint32 little-endian, journalMagic
//	length  uint32 little-endian, the payload's length in bytes
//	crc     uint32 little-endian, CRC-32C of the length field and the payload
//	payload JSON Record: {"seq": n, "put": <catalog service>},
//	        {"seq": n, "delete": "<name>"} or {"seq": n, "policies": {...}}
//
// A change is acknowledged (Wait returns nil) only once its record is
// written and the journal file fsynced (and, for the first record of a
// new journal file, its directory). Concurrent changes share one write
// and one fsync (group commit).
//
// Compaction writes the state of the catalog as a new snapshot in the
// background once the journal has grown as large as the last snapshot
// (and at least Config.CompactMinBytes), so that the journal's cost per
// change stays constant: the records from then on go to the next journal
// file, and the older journal files are removed once the snapshot is in
// place. Load replays the journal files over the snapshot (records the
// snapshot includes are skipped); the façade restores the result and
// compacts it. Close compacts too, so that after a clean stop the
// snapshot alone is the catalog.
//
// Only the end of the last journal file can be torn by a crash, and only
// by a record that was never acknowledged: a record that fails its
// checksum or is cut short, with no valid record after it, is dropped
// with a warning. A damaged record followed by valid ones, or a gap in
// the sequence numbers, means acknowledged changes were lost: Load fails
// with ErrCorrupt and the file and offset.
package catalog

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"time"

	"github.com/fluxvm/servicefabric/intent"
	"github.com/fluxvm/servicefabric/internal/atomicfile"
)

// Version is the format of the catalog file.
const Version = 1

// File is the node-local copy of Fabric's intent, with the datapath ids
// each frontend and backend was given, so that a restarted node keeps the
// ids its conntrack entries name and established flows stay put.
//
// Seq is the sequence number of the last journal record the file
// includes; a file without it includes none.
type File struct {
	Version  int       `json:"version"`
	Seq      uint64    `json:"journal_seq,omitempty"`
	Services []Service `json:"services"`
	// Policies is the identity policy state: the ipcache and the
	// services' policies; nil: none was ever set.
	Policies *Policies `json:"policies,omitempty"`
}

// Policies is what the identity policies are compiled from, as the last
// reconcile applied it.
type Policies struct {
	IPCache  intent.IPCache  `json:"ipcache"`
	Policies []intent.Policy `json:"policies"`
	// IDs are the policies' datapath ids by service: kept across a
	// restart, so that the rule sets the kept maps hold stay their
	// policies' until the restore has written every header.
	IDs map[string]uint32 `json:"ids,omitempty"`
}

// Service is a service as the catalog records it: its intent, revision,
// when it was applied, and the ids of its frontends and backends.
type Service struct {
	Service   intent.Service `json:"service"`
	Revision  uint64         `json:"revision"`
	AppliedAt time.Time      `json:"applied_at"`
	Frontends []Frontend     `json:"frontends"`
}

// Frontend is one VIP, port and protocol of a service, with its service
// id and its backends' ids.
type Frontend struct {
	VIP       netip.Addr      `json:"vip"`
	Port      uint16          `json:"port"`
	Protocol  intent.Protocol `json:"protocol"`
	ServiceID uint32          `json:"service_id"`
	Backends  []Backend       `json:"backends"`
}

// Backend is a backend of a frontend with its backend id.
type Backend struct {
	Endpoint  netip.AddrPort `json:"endpoint"`
	BackendID uint32         `json:"backend_id"`
}

// ReadFile reads the catalog file (the snapshot alone, without its
// journal) at path. A missing file is an empty catalog.
func ReadFile(path string) (File, error) {
	var c File
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return File{Version: Version}, nil
	}
	if err != nil {
		return c, fmt.Errorf("fluxvm: catalog: %w", err)
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return c, fmt.Errorf("fluxvm: catalog %s: %w", path, err)
	}
	if c.Version != Version {
		return c, fmt.Errorf("fluxvm: catalog %s: version %d, want %d", path, c.Version, Version)
	}
	return c, nil
}

// WriteFile writes cat as the catalog file at path, atomically, and
// returns its size. It is how a compaction writes the snapshot.
func WriteFile(path string, cat File) (int64, error) {
	data, err := json.MarshalIndent(cat, "", "  ")
	if err != nil {
		return 0, err
	}
	if err := atomicfile.Write(path, data, 0o600); err != nil {
		return 0, err
	}
	return int64(len(data)), nil
}

// Remove removes the catalog at path and its journal files. A missing
// catalog is not an error.
func Remove(path string) error {
	var errs []error
	if err := removeIfExists(path); err != nil {
		errs = append(errs, err)
	}
	files, err := journalFiles(path)
	errs = append(errs, err)
	for _, jf := range files {
		errs = append(errs, removeIfExists(jf.path))
	}
	return errors.Join(errs...)
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
