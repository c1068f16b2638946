package fluxvm

import (
	"errors"

	"github.com/fluxvm/servicefabric/intent"
)

// Error categories, checkable with errors.Is. The REST API maps each to a
// stable error code and HTTP status.
//
// ErrInvalid, ErrUnsupported, ErrConflict and ErrLimit are those of
// package intent (the same values, so errors.Is holds with either name);
// ErrNotFound and ErrClosed are a running dataplane's.
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
	// ErrNotFound: no such service or VM.
	ErrNotFound = errors.New("not found")
	// ErrClosed: the Dataplane was closed (Close or Cleanup); it reads
	// and changes no map any more (see Dataplane.Close; Cleanup still
	// removes what is left).
	ErrClosed = errors.New("dataplane closed")
)
