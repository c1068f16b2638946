package fluxvm

import (
	"errors"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
	"github.com/fluxvm/servicefabric/intent"
)

// Error categories, checkable with errors.Is. The REST API maps each to a
// stable error code and HTTP status.
//
// ErrInvalid, ErrUnsupported, ErrConflict and ErrLimit are those of
// package intent (the same values, so errors.Is holds with either name);
// ErrNotFound and ErrClosed are a running dataplane's (package
// fluxvm/internal/errs, which its components share).
var (
	// ErrInvalid: the request is malformed or out of range (intent.ErrInvalid).
	ErrInvalid = intent.ErrInvalid
	// ErrUnsupported: the request asks for a feature this build or this
	// kernel does not have (intent.ErrUnsupported).
	ErrUnsupported = intent.ErrUnsupported
	// ErrConflict: the request clashes with other state (for example a
	// frontend another service already uses) (intent.ErrConflict).
	ErrConflict = intent.ErrConflict
	// ErrLimit: the request would exceed a documented bound or a map
	// capacity of the loaded tier (intent.ErrLimit).
	ErrLimit = intent.ErrLimit
	// ErrNotFound: no such service or VM, or no such network interface
	// (AddInterface, AddNorthSouthInterface and Open's interfaces: the
	// error also matches bpf.ErrNoInterface).
	ErrNotFound = errs.ErrNotFound
	// ErrClosed: the Dataplane was closed (Close or Cleanup); it reads
	// and changes no map any more (see Dataplane.Close; Cleanup still
	// removes what is left).
	ErrClosed = errs.ErrClosed
)

// ifaceError adds ErrNotFound to the chain of an error that says the node
// has no such network interface (bpf.ErrNoInterface), keeping its message,
// so that a missing interface matches the same category as a missing
// service or VM.
func ifaceError(err error) error {
	if err == nil || !errors.Is(err, bpf.ErrNoInterface) || errors.Is(err, ErrNotFound) {
		return err
	}
	return &categorized{err: err, category: ErrNotFound}
}

// categorized is err with a category of this package in its chain.
type categorized struct{ err, category error }

func (e *categorized) Error() string   { return e.err.Error() }
func (e *categorized) Unwrap() []error { return []error{e.err, e.category} }
