package advert

import "errors"

// Error categories, checkable with errors.Is. Every error this package
// returns starts with "advert: " and names the operation and, for files,
// the path.
var (
	// ErrInvalid: an entry given to Publish breaks a rule of the contract
	// (no VIP, no service name, a duplicate, a reason on an advertised
	// entry or none on a withdrawn one, ...). Nothing is written.
	ErrInvalid = errors.New("invalid entry")
	// ErrCorrupt: a file or document is not a valid snapshot of the
	// supported schema version (not JSON, wrong types, entries that break
	// the rules or are not in canonical order).
	ErrCorrupt = errors.New("not a valid advertisement snapshot")
	// ErrSchemaVersion: a snapshot has a schema_version this package does
	// not read.
	ErrSchemaVersion = errors.New("unsupported schema version")
)
